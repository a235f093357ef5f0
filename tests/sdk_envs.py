"""One small virtual environment per Tinker SDK version, built once and cached.

`python -m venv` plus `uv pip install tinker==X` (nothing but the SDK and its own dependencies) under
`${TXFLOW_CACHE:-~/.cache/txflow}/sdk-envs/tinker-X`; uv is the one `make venv` installs beside this
interpreter. Torch, which the SDK's custom losses need (`forward_backward_custom` raises "PyTorch is
not installed" without it), is installed once, by pip (uv does not look for the CPU wheel on this
machine's disk), into a layer of its own that every SDK environment reads through a `.pth` file,
after its own packages: one install of a large wheel instead of one per version. uv resolves every
SDK environment with torch excluded, so nothing there can pull another build of it. An environment
counts as built only once its marker file exists and names the same install steps; the marker is
written last and records the build time and size. Builders of one environment take a file lock, so
two tests that want it at once build it once.
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
TORCH = "torch==2.13.0"  # the CPU wheel this machine offers; the project's own pin
UV = Path(sys.executable).parent / "uv"


def cache_root() -> Path:
    return Path(os.environ.get("TXFLOW_CACHE") or Path.home() / ".cache" / "txflow") / "sdk-envs"


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def sdk_env(version: str, steps: tuple[tuple[str, ...], ...] = (), name: str | None = None) -> Path:
    """The environment holding `tinker==version` (and the torch layer), built if absent or incomplete:
    `uv pip install tinker==version`, then one install per entry of `steps`. Returns its directory;
    its interpreter is `<dir>/bin/python`."""
    layer = torch_layer()
    return _build(cache_root() / (name or f"tinker-{version}"), ((f"tinker=={version}",), *steps), layer)


def torch_layer() -> Path:
    """The site-packages of the shared torch layer."""
    return _site_packages(_build(cache_root() / TORCH.replace("==", "-"), ((TORCH,),), None))


def _site_packages(root: Path) -> Path:
    return root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _build(root: Path, steps: tuple[tuple[str, ...], ...], layer: Path | None) -> Path:
    if _built(root, steps, layer):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built(root, steps, layer):  # built by whoever held the lock before us
            return root
        shutil.rmtree(root, ignore_errors=True)  # a build that died half-way
        began = time.monotonic()
        python = root / "bin" / "python"
        if layer is None:  # the torch layer: pip, which takes the CPU wheel on this machine's disk
            subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True, timeout=300)
            install = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        else:  # uv: 3-4x faster than pip here (docs/performance.md); torch comes from the layer, read last
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True,
                           capture_output=True, timeout=300)
            (_site_packages(root) / "txflow-torch-layer.pth").write_text(f"{layer}\n")
            (root / "txflow-excludes.txt").write_text("torch\n")
            install = [str(UV), "pip", "install", "--quiet", "--compile-bytecode", "--python", str(python),
                       "--excludes", str(root / "txflow-excludes.txt")]
        for step in steps:
            done = subprocess.run(install + list(step), capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(install[:3])} {' '.join(step)} into {root} failed:\n"
                                   f"{done.stderr[-3000:]}")
        record = {"steps": [list(step) for step in steps], "layer": str(layer) if layer else None,
                  "build_seconds": round(time.monotonic() - began, 1), "bytes": tree_bytes(root)}
        (root / MARKER).write_text(json.dumps(record))
    return root


def _built(root: Path, steps: tuple[tuple[str, ...], ...], layer: Path | None) -> bool:
    try:
        record = json.loads((root / MARKER).read_text())
        return record["steps"] == [list(step) for step in steps] and record["layer"] == (str(layer) if layer else None)
    except (FileNotFoundError, KeyError, ValueError):
        return False


def build_record(env: Path) -> dict:
    """What the marker recorded: install steps, the torch layer, build seconds, bytes."""
    return json.loads((env / MARKER).read_text())
