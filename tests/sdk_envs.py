"""One small virtual environment per Tinker SDK version, built once and cached.

`python -m venv` plus `pip install tinker==X` (nothing but the SDK and its own
dependencies) under `${TXFLOW_CACHE:-~/.cache/txflow}/sdk-envs/tinker-X`. An
environment counts as built only once its marker file exists; the marker is
written last and records the build time and size. Builders of one version take
a file lock, so two tests that want it at once build it once.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SDK_VERSIONS = ("0.13.1", "0.25.0", "0.38.0")
MARKER = "txflow-sdk-env.json"


def cache_root() -> Path:
    return Path(os.environ.get("TXFLOW_CACHE") or Path.home() / ".cache" / "txflow") / "sdk-envs"


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def sdk_env(version: str, steps: tuple[tuple[str, ...], ...] = (), name: str | None = None) -> Path:
    """The environment holding `tinker==version`, built if absent or incomplete: `pip install
    tinker==version`, then one `pip install` per entry of `steps`. Returns its directory; its
    interpreter is `<dir>/bin/python`."""
    root = cache_root() / (name or f"tinker-{version}")
    if (root / MARKER).exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / MARKER).exists():  # built by whoever held the lock before us
            return root
        shutil.rmtree(root, ignore_errors=True)  # a build that died half-way
        began = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True, timeout=300)
        pip = [str(root / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        for step in ((f"tinker=={version}",), *steps):
            done = subprocess.run(pip + list(step), capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"pip install {' '.join(step)} into {root} failed:\n{done.stderr[-3000:]}")
        record = {"tinker": version, "steps": [list(step) for step in steps],
                  "build_seconds": round(time.monotonic() - began, 1), "bytes": tree_bytes(root)}
        (root / MARKER).write_text(json.dumps(record))
    return root


def build_record(env: Path) -> dict:
    """What the marker recorded: tinker version, extra steps, build seconds, bytes."""
    return json.loads((env / MARKER).read_text())
