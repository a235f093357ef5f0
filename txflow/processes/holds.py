"""Hold points: a test stops a step at a named place until it releases it.

A fault test must land its fault in a given step; watching log lines and signalling a process from
outside races the step on a loaded machine. `hold_point(name)` instead waits, in the step itself,
while the test does what it must (kill a rank) and then releases it. Off unless the environment
variable TXFLOW_HOLD_AT names the point (names separated by commas); then the point writes
`<TXFLOW_HOLD_DIR>/<name>.held` and waits until `<name>.release` exists there. A release stays:
once released, every later pass (a retry) goes straight through.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from txflow.log import get_logger

HOLD_AT = "TXFLOW_HOLD_AT"
HOLD_DIR = "TXFLOW_HOLD_DIR"


def hold_point(name: str, timeout_s: float = 600.0) -> None:
    """Wait here until the test releases `name`, when TXFLOW_HOLD_AT names it; else return at once.

    Raises TimeoutError after `timeout_s` without a release, so a forgotten release cannot hang a run.
    """
    if name not in os.environ.get(HOLD_AT, "").split(","):
        return
    directory = Path(os.environ.get(HOLD_DIR, "."))
    release = directory / f"{name}.release"
    get_logger().info(f"held at {name} until {release} exists")
    (directory / f"{name}.held").write_text(f"{os.getpid()}\n")
    deadline = time.monotonic() + timeout_s
    while not release.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"hold point {name}: no {release} within {timeout_s:g} s ({HOLD_AT} names it)")
        time.sleep(0.05)
