"""Helpers shared by the tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from txflow.processes import is_alive


def cluster_pids(state_dir: Path) -> list[tuple[int, int | None]]:
    """(pid, start_time) of every process recorded in cluster.json."""
    data = json.loads((Path(state_dir) / "cluster.json").read_text())
    return [(p["pid"], p["start_time"]) for p in data["processes"]]


def alive_pids(state_dir: Path) -> list[int]:
    return [pid for pid, started in cluster_pids(state_dir) if is_alive(pid, started)]


def txflow_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "txflow.cli", *args]


def run_txflow(args: list[str], env: dict, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(txflow_cmd(*args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
