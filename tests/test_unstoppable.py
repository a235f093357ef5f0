"""A process that SIGKILL cannot take (uninterruptible sleep) does not stop the teardown: it is named in
cluster.json and the report's ranks, and the stop returns, so the run still writes its report."""

from __future__ import annotations

import json
import subprocess
import sys

from txflow.cluster.launchers.local import LocalLauncher
from txflow.cluster.records import Cluster, as_json


def test_a_rank_that_outlives_sigkill_is_named_and_the_stop_returns(tmp_path):
    state = tmp_path / "state"
    (state / "logs").mkdir(parents=True)
    cluster = Cluster(run_id="stuck", launcher="local", state_dir=str(state), host="127.0.0.1", api_port=1,
                      coordinator_port=None, num_processes=1, base_model_path="x", checkpoints_base="y")
    launcher = LocalLauncher()
    sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
    api = launcher.start(cluster, "api", None, sleeper, {}, {}, "api")
    rank0 = launcher.start(cluster, "coordinator", 0, sleeper, {}, {}, "rank0")
    stuck = launcher._popen[rank0.pid]
    real_wait = stuck.wait

    def in_uninterruptible_sleep(timeout=None):
        # As a process in D state answers: SIGKILL is pending, the process has not exited.
        raise subprocess.TimeoutExpired(stuck.args, timeout)

    stuck.wait = in_uninterruptible_sleep
    try:
        records = launcher.stop(cluster, grace_s=1.0)
    finally:
        stuck.wait = real_wait
        real_wait(timeout=10)  # the real process did die of the SIGKILL
    by_role = {r.role: r for r in records}
    assert by_role["api"].exit_code == -15 and not by_role["api"].unstoppable
    assert by_role["coordinator"].unstoppable and by_role["coordinator"].exit_code is None
    assert by_role["coordinator"].exit_text.startswith("still running after SIGKILL")
    saved = json.loads((state / "cluster.json").read_text())["processes"]
    assert [p["unstoppable"] for p in saved] == [False, True]
    assert [r["unstoppable"] for r in as_json(records)] == [False, True]
    assert api.pid != rank0.pid
