"""What /proc says of a process: whether it lives, when it started, its group and parent."""

from __future__ import annotations

from pathlib import Path


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
