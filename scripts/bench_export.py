"""Benchmark: what export-adapter adds to the demo, `txflow run sft` with the export against the same run without.

Runs the demo job (`txflow run sft`, defaults: 20 steps, 2 processes) with `--export` and with `--no-export`,
alternating, in pairs, on the same machine with the same warm caches (one unmeasured run first), and
compares whole-process wall times. Prints each pair, the median ratio (target <= 1.15), and the export
step's own seconds from the report.

    python scripts/bench_export.py [--pairs 3]
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.export_adapter import export_adapter  # noqa: E402
from txflow.reporting.report import RunReport  # noqa: E402

TARGET = 1.15


def demo(work: Path, env: dict, name: str, export: bool) -> tuple[float, RunReport]:
    """Wall seconds of one `txflow run sft` and its report."""
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "txflow.cli", "run", "sft", "--base-model", "tiny", "--run-id", name,
                             "--checkpoints", str(work / "ckpt"), "--state-dir", str(work / "states" / name),
                             "--export" if export else "--no-export", "--json"],
                            env=env, cwd=work, capture_output=True, text=True, timeout=1200)
    seconds = time.monotonic() - began
    if result.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{result.stderr[-3000:]}")
    return seconds, RunReport.read(result.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-export-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its processes have stopped by then
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(work / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               TINKER_TELEMETRY="0")
    demo(work, env, "warm-up", True)  # compiled programs and the Prefect database, as a user's second run finds them
    ratios, export_steps = [], []
    for pair in range(args.pairs):
        # Alternate which side goes first, so a drift of the machine does not favour one side.
        order = (True, False) if pair % 2 == 0 else (False, True)
        seconds = {}
        for export in order:
            seconds[export], report = demo(work, env, f"{'export' if export else 'plain'}-{pair}", export)
            if export:
                export_steps.append(report.seconds(export_adapter))
                assert report.export.passed, report.export
        ratios.append(seconds[True] / seconds[False])
        print(f"pair {pair + 1}: with export {seconds[True]:.1f} s, without {seconds[False]:.1f} s, ratio "
              f"{ratios[-1]:.3f} (export-adapter step {export_steps[-1]:.1f} s)", flush=True)
    ratio = statistics.median(ratios)
    print(f"export: median ratio {ratio:.3f} over {args.pairs} pairs (target <= {TARGET}); export-adapter step "
          f"median {statistics.median(export_steps):.1f} s")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
