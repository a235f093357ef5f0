"""Child processes: each in its own process group, stopped as a group.

SkyRL-tx processes ignore SIGTERM in practice (the API, the engine and the JAX
workers all survived it in a 2-rank trial), so stopping is SIGTERM to the
whole group, a grace period, then SIGKILL to the group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from txflow.processes.procfs import proc_stats


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: str | None = None,
          pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start `cmd` in a new session (its own process group), stdout+stderr appended to `log_path`; the
    file descriptors `pass_fds` stay open in it under the same numbers."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
            pass_fds=pass_fds,
        )


def group_alive(pgid: int) -> bool:
    """True while any live (not zombie) process of group `pgid` exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return any(int(fields[2]) == pgid and fields[0] != "Z" for _, fields in proc_stats())


def stop_groups(pgids: list[int], grace_s: float = 5.0) -> None:
    """SIGTERM each process group, wait up to `grace_s` for all, then SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pgid in pgids:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while any(group_alive(pgid) for pgid in pgids) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not any(group_alive(pgid) for pgid in pgids):
            return
