"""Child processes: each in its own process group, stopped as a group.

SkyRL-tx processes ignore SIGTERM in practice (the API, the engine and the JAX
workers all survived it in a 2-rank trial), so stopping is SIGTERM to the
whole group, a grace period, then SIGKILL to the group.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.Popen:
    """Start `cmd` in a new session (its own process group), stdout+stderr appended to `log_path`."""
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
        )


def start_time(pid: int) -> int | None:
    """Kernel start time of `pid` (clock ticks since boot), or None if it does not exist.

    Used with the pid to tell a process we started from an unrelated one that
    got the same pid later.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces; fields after it are fixed.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def is_alive(pid: int, started: int | None = None) -> bool:
    """True while `pid` runs (and, if given, is the process that started at `started`)."""
    now = start_time(pid)
    return now is not None and (started is None or now == started)


def proc_stats():
    """(pid, fields after the command name of /proc/<pid>/stat) of every process: state, ppid, pgrp, ..."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            yield int(entry.name), stat[stat.rindex(")") + 2 :].split()


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


def tail(path: Path | str, lines: int = 30) -> str:
    """The last `lines` lines of a text file ('' when it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
