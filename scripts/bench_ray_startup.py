"""Benchmark: cluster start-up with `--launcher ray` divided by `--launcher local`, same machine, same run.

Starts a two-node Ray cluster on this machine inside a private network namespace
(`tests/ray_cluster.py`; needs root), then runs the same one-step SFT job with
each launcher, alternating, inside that namespace, and compares the cluster
start-up the report records: provision-coordinator + launch-workers (placing
the ranks, starting API and ranks, and the readiness sample every rank takes
part in). The Ray cluster is running before either side starts, as a user's
existing cluster is. Prints the medians and their ratio (target <= 1.2).

    python scripts/bench_ray_startup.py [--repeats 2]
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tasks.launch_workers import launch_workers  # noqa: E402
from tasks.provision_coordinator import provision_coordinator  # noqa: E402
from tests.ray_cluster import running_cluster  # noqa: E402
from txflow.reporting.report import RunReport  # noqa: E402


def start_up(cluster, env: dict, work: Path, launcher: str, index: int) -> float:
    run_id = f"{launcher}-{index}"
    log = work / f"{run_id}.log"
    proc = cluster.spawn([sys.executable, "-m", "txflow.cli", "run", "sft", "--base-model", "tiny", "--launcher",
                          launcher, "--steps", "1",
                          "--save-every", "0", "--run-id", run_id, "--state-dir", str(work / "states" / run_id),
                          "--checkpoints", str(work / "ckpt"), "--json"], log, env=env)
    if proc.wait(timeout=900) != 0:
        raise SystemExit(f"{launcher} run failed; see {log}")
    text = log.read_text()
    report = RunReport.read(text[text.find('{\n  "run_id"'):text.rindex("}") + 1])
    return report.seconds(provision_coordinator, launch_workers)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: the Ray cluster runs in a private network namespace")
    work = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its processes have stopped by then
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API_URL", "RAY_ADDRESS"))}
    env.update(PREFECT_HOME=str(work / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="1", TINKER_TELEMETRY="0")
    subprocess.run([str(Path(sys.executable).parent / "prefect"), "server", "database", "upgrade", "-y"], env=env,
                   check=True, capture_output=True, timeout=300)
    seconds: dict[str, list[float]] = {"local": [], "ray": []}
    with running_cluster(workers=1, num_cpus=1) as cluster:
        env["RAY_ADDRESS"] = cluster.address
        for index in range(args.repeats):
            for launcher in ("local", "ray"):
                seconds[launcher].append(start_up(cluster, env, work, launcher, index))
    local, ray_ = statistics.median(seconds["local"]), statistics.median(seconds["ray"])
    print(f"cluster start-up (provision + launch-workers), median of {args.repeats}: "
          f"local {local:.1f} s {seconds['local']}, ray {ray_:.1f} s {seconds['ray']}, "
          f"ratio ray/local {ray_ / local:.2f} (target <= 1.2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
