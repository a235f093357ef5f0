"""metrics.jsonl in the run's local state directory (copied to the run root with the report)."""

from __future__ import annotations

import json
from pathlib import Path


def metrics_path(state_dir: str) -> Path:
    return Path(state_dir) / "metrics.jsonl"


def read_metrics(state_dir: str, up_to_step: int | None = None) -> list[dict]:
    path = metrics_path(state_dir)
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if up_to_step is None or r["step"] <= up_to_step]


def write_metrics(state_dir: str, rows: list[dict]) -> None:
    metrics_path(state_dir).write_text("".join(json.dumps(r) + "\n" for r in rows))


def append_metric(state_dir: str, row: dict) -> None:
    with open(metrics_path(state_dir), "a") as f:
        f.write(json.dumps(row) + "\n")
