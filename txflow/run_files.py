"""Files of a run in its local state directory: metrics.jsonl and progress.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, Field


class SavedState(BaseModel):
    step: int
    path: str = Field(description="tinker:// path returned by save_state")


class Progress(BaseModel):
    """What a retry of the train step resumes from."""

    states: list[SavedState] = Field(default_factory=list)

    @classmethod
    def load(cls, state_dir: str) -> Progress:
        path = Path(state_dir) / "progress.json"
        return cls.model_validate_json(path.read_text()) if path.exists() else cls()

    def add(self, state_dir: str, step: int, path: str) -> None:
        self.states.append(SavedState(step=step, path=path))
        target = Path(state_dir) / "progress.json"
        tmp = target.with_suffix(".tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        os.replace(tmp, target)

    @property
    def latest(self) -> SavedState | None:
        return self.states[-1] if self.states else None


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
