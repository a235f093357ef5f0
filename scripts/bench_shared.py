"""Benchmark: one warm cluster for many runs. A sweep of 4 toy SFT runs side by side on one
shared cluster (`txflow sweep`, which starts the cluster, the start-up included) against the same 4 runs
each with its own cluster, one after another (`txflow run`, as before the shared cluster), same machine,
same warm caches (one unmeasured run and one unmeasured sweep first). Prints both wall times and their
ratio (target <= 0.4), and the median per-step time of one adapter alone (the own-cluster runs; steps 2..
past the JIT) against four side by side (the sweep's members).

    python scripts/bench_shared.py [--steps 10] [--processes 1]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = 0.4
RATES = ["1e-2", "2e-2", "3e-2", "5e-2"]


def txflow(args: list[str], work: Path, env: dict) -> tuple[float, subprocess.CompletedProcess]:
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "txflow.cli", *args], env=env, cwd=work, capture_output=True,
                            text=True, timeout=3600)
    return time.monotonic() - began, result


def step_times(report: dict) -> list[float]:
    return [m["seconds"] for m in report["metrics"][1:]]  # the first step compiles


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-shared-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its processes have stopped by then
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(work / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               TINKER_TELEMETRY="0", TXFLOW_CLUSTERS_DIR=str(work / "clusters"))
    common = ["--base-model", "tiny", "--steps", str(args.steps), "--processes", str(args.processes), "--no-export",
              "--checkpoints", str(work / "ckpt")]
    # Each side's shapes compiled once, unmeasured (JAX's persistent cache keeps them): one run alone, and one
    # sweep of four, whose engine batches the four adapters' requests together (shapes a run alone never has).
    _, warm = txflow(["run", "sft", *common, "--run-id", "warm-up", "--state-dir", str(work / "warm-up")], work, env)
    if warm.returncode != 0:
        raise SystemExit(f"warm-up failed:\n{warm.stderr[-3000:]}")
    _, warm = txflow(["sweep", "sft", *common, "--learning-rate", ",".join(RATES), "--sweep-id", "warm-sweep",
                      "--state-dir", str(work / "warm-sweep")], work, env)
    if warm.returncode != 0:
        raise SystemExit(f"warm-up sweep failed:\n{warm.stderr[-3000:]}")
    alone, own_total = [], 0.0
    for i, rate in enumerate(RATES):
        seconds, result = txflow(["run", "sft", *common, "--learning-rate", rate, "--run-id", f"own-{i}",
                                  "--state-dir", str(work / f"own-{i}"), "--json"], work, env)
        if result.returncode != 0:
            raise SystemExit(f"run own-{i} failed:\n{result.stderr[-3000:]}")
        own_total += seconds
        alone += step_times(json.loads(result.stdout))
        print(f"own cluster {i + 1}/4: {seconds:.1f} s", flush=True)
    shared_total, result = txflow(["sweep", "sft", *common, "--learning-rate", ",".join(RATES), "--sweep-id", "bench",
                                   "--state-dir", str(work / "sweep"), "--json"], work, env)
    if result.returncode != 0:
        raise SystemExit(f"the sweep failed:\n{result.stderr[-3000:]}")
    side_by_side = []
    for row in json.loads(result.stdout)["members"]:
        side_by_side += step_times(json.loads((work / "ckpt" / row["run_id"] / "report.json").read_text()))
    ratio = shared_total / own_total
    step_alone, step_four = statistics.median(alone), statistics.median(side_by_side)
    print(f"4 runs, each its own cluster, one after another: {own_total:.1f} s; the same 4 as a sweep on one shared "
          f"cluster: {shared_total:.1f} s; ratio {ratio:.3f} (target <= {TARGET})")
    print(f"per-step time: one adapter alone {step_alone:.3f} s, four side by side {step_four:.3f} s (ratio "
          f"{step_four / step_alone:.2f}; four steps done in that time)")
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
