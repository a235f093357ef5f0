"""The logs of the processes txflow starts: one file each, read from the end."""

from __future__ import annotations

import os
from pathlib import Path


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
