"""The rank monitor is the one source of health: it names a dead process once, within its
production interval, and every wait on the cluster asks it (ClusterHandle.wait)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import threading
import time

import pytest

from txflow.cluster import handle as handle_module
from txflow.cluster.handle import ClusterHandle
from txflow.cluster.launchers.local import LocalLauncher
from txflow.cluster.monitor import NoProgress, RankDied, RankMonitor
from txflow.cluster.records import Cluster, ProcessRecord

pytestmark = [pytest.mark.timed]

SLEEPER = [sys.executable, "-c", "print('rank alive', flush=True); import time; time.sleep(60)"]


def make_cluster(tmp_path) -> Cluster:
    (tmp_path / "logs").mkdir(exist_ok=True)
    return Cluster(run_id="m", launcher="local", state_dir=str(tmp_path), host="127.0.0.1", api_port=1,
                   coordinator_port=None, num_processes=2, base_model_path="x", checkpoints_base="y")


@pytest.fixture
def two_ranks(tmp_path):
    """Two sleeping 'ranks' under a LocalLauncher; stopped at the end whatever happened."""
    cluster, launcher = make_cluster(tmp_path), LocalLauncher()
    for rank in (0, 1):
        launcher.start(cluster, "coordinator" if rank == 0 else "worker", rank, SLEEPER, dict(os.environ), {},
                       f"rank{rank}")
    yield cluster, launcher
    launcher.stop(cluster, grace_s=1.0)


class PollSignal(LocalLauncher):
    """The local launcher, signalling each health poll of rank 1, so a test can kill it right after one
    (the worst case)."""

    def __init__(self, launcher: LocalLauncher):
        super().__init__()
        self.__dict__.update(launcher.__dict__)
        self.polled = threading.Event()

    def exit_code(self, record):
        code = super().exit_code(record)
        if record.rank == 1:
            self.polled.set()
        return code


def test_monitor_reports_a_dead_rank_once_within_its_production_interval(two_ranks):
    cluster, launcher = two_ranks
    launcher = PollSignal(launcher)
    monitor = RankMonitor(cluster, launcher).start()  # the interval the flow uses
    try:
        time.sleep(1.2)
        assert monitor.failures == []
        # Kill just after a poll: the death waits a whole interval to be seen, which must still be within
        # docs/clusters.md's 2 s (with margin for a busy machine).
        launcher.polled.clear()
        assert launcher.polled.wait(timeout=5)
        killed_at = time.time()
        os.kill(cluster.rank(1).pid, signal.SIGKILL)
        assert monitor.failed.wait(timeout=5)
        time.sleep(1.5)  # several more polls
        [failure] = monitor.failures
        assert (failure.rank, failure.exit_code) == (1, -signal.SIGKILL)
        assert failure.detected_at - killed_at <= min(monitor.interval_s + 0.3, 1.5)
        assert "rank 1 (worker)" in failure.message and "rank alive" in failure.message
    finally:
        monitor.stop()


def test_a_request_in_flight_is_abandoned_as_soon_as_the_monitor_sees_a_death(two_ranks):
    """From the kill to the moment the failed wait returns to its caller: within the monitor's
    interval, not JAX's ~90 s heartbeat abort (the future itself never completes)."""
    cluster, launcher = two_ranks
    handle = ClusterHandle.watch(cluster, launcher)
    never = concurrent.futures.Future()
    killed_at = []

    def kill() -> None:  # the time of the kill itself: a timer thread can fire late on a busy machine
        killed_at.append(time.time())
        os.kill(cluster.rank(1).pid, signal.SIGKILL)

    try:
        killer = threading.Timer(1.0, kill)
        killer.start()
        with pytest.raises(RankDied) as died:
            handle.wait(never, "a training step", timeout_s=60)
        returned_at = time.time()
        killer.join()
        assert died.value.failure.rank == 1
        assert returned_at - killed_at[0] <= min(handle.monitor.interval_s + 0.3, 1.5)
    finally:
        handle.monitor.stop()


def test_an_sdk_call_that_blocks_on_the_engine_is_abandoned_at_a_death_and_otherwise_returns(two_ranks):
    """Creating a training client waits inside the SDK: with the engine (rank 0) dead, the API answers
    "pending" forever. `call` abandons it like any wait, and gives back a result or an error otherwise."""
    cluster, launcher = two_ranks
    handle = ClusterHandle.watch(cluster, launcher)
    forever = threading.Event()
    try:
        assert handle.call(lambda: "client", "creating a training client", timeout_s=10) == "client"
        with pytest.raises(ValueError, match="refused"):
            handle.call(lambda: (_ for _ in ()).throw(ValueError("refused")), "creating", timeout_s=10)
        killer = threading.Timer(1.0, lambda: os.kill(cluster.rank(0).pid, signal.SIGKILL))
        killer.start()
        began = time.time()
        with pytest.raises(RankDied) as died:
            handle.call(forever.wait, "creating a training client", timeout_s=60)
        killer.join()
        assert died.value.failure.rank == 0
        # Abandoned at the death, not at its 60 s timeout (how fast a death is seen is tested above).
        assert time.time() - began < 10
    finally:
        forever.set()  # ends the abandoned call's thread
        handle.monitor.stop()


def test_a_result_is_returned_without_a_polling_delay(two_ranks):
    cluster, launcher = two_ranks
    handle = ClusterHandle.watch(cluster, launcher)
    future = concurrent.futures.Future()
    try:
        threading.Timer(0.3, lambda: future.set_result("done")).start()
        began = time.monotonic()
        assert handle.wait(future, "a request", timeout_s=10) == "done"
        assert time.monotonic() - began < 0.3 + 0.1
    finally:
        handle.monitor.stop()


def test_a_request_without_progress_is_a_no_progress_fault(two_ranks):
    cluster, launcher = two_ranks
    handle = ClusterHandle.watch(cluster, launcher)
    try:
        with pytest.raises(NoProgress, match="a save made no progress for 1 s"):
            handle.wait(concurrent.futures.Future(), "a save", timeout_s=1)
    finally:
        handle.monitor.stop()


class Opaque:
    """A future with only `result()`, like the SDK's combined future of chunked requests."""

    def __init__(self):
        self.done = threading.Event()

    def result(self):
        self.done.wait()
        return "late"


def test_a_thousand_abandoned_waits_leave_no_thread_per_request(two_ranks):
    # A long-lived worker abandons waits (a death, a deadline) whose futures never resolve: no thread may
    # stay blocked per request, whatever kind of future it was.
    cluster, launcher = two_ranks
    handle = ClusterHandle.watch(cluster, launcher)
    before = threading.active_count()
    opaque = [Opaque() for _ in range(500)]
    try:
        for future in [concurrent.futures.Future() for _ in range(500)] + opaque:
            with pytest.raises(NoProgress):
                handle.wait(future, "a request", timeout_s=0.001)
        assert threading.active_count() - before <= handle_module.WAIT_THREADS
        late = concurrent.futures.Future()
        threading.Timer(0.2, lambda: late.set_result("on time")).start()
        assert handle.wait(late, "a request", timeout_s=10) == "on time"  # waits still work
    finally:
        for future in opaque:
            future.done.set()
        handle.stop(grace_s=1.0)


def test_a_failed_request_is_blamed_on_the_rank_that_died_not_on_the_peer_error(two_ranks):
    """A dead worker surfaces first as a gloo error of the request in flight; the error the flow
    sees names the dead rank, even before the monitor's own next poll."""
    cluster, launcher = two_ranks
    handle = ClusterHandle(cluster=cluster, launcher=launcher,
                           monitor=RankMonitor(cluster, launcher, interval_s=3600).start())
    future = concurrent.futures.Future()
    try:
        os.kill(cluster.rank(1).pid, signal.SIGKILL)
        time.sleep(0.3)
        future.set_exception(RuntimeError("gloo: connection closed by peer"))
        with pytest.raises(RankDied) as died:
            handle.wait(future, "a training step", timeout_s=10)
        assert died.value.failure.rank == 1
    finally:
        handle.monitor.stop()


class DeadRankLauncher(LocalLauncher):
    """Reports rank 1 as killed by SIGKILL, without starting anything."""

    def exit_code(self, record):
        return -signal.SIGKILL if record.rank == 1 else None


def test_a_death_the_monitor_thread_is_recording_still_counts_as_a_cluster_fault(tmp_path, monkeypatch):
    # Seen in the fault test: the request failed with RankDied while the monitor thread had marked
    # the dead rank seen but not yet recorded it; the flow's own poll found nothing new and failed
    # the run instead of retrying on a fresh cluster.
    from flows.train import _cluster_fault
    from txflow.cluster import monitor as monitor_module

    cluster = make_cluster(tmp_path)
    cluster.processes = [ProcessRecord(role=role, rank=rank, pid=pid, pgid=pid, host="127.0.0.1", log="")
                         for role, rank, pid in (("coordinator", 0, 10**7), ("worker", 1, 10**7 + 1))]
    describing = threading.Event()
    real_describe = monitor_module.describe_exit

    def slow_describe(*args):  # the log tail is read between "seen" and "recorded"
        describing.set()
        time.sleep(0.5)
        return real_describe(*args)

    monkeypatch.setattr(monitor_module, "describe_exit", slow_describe)
    launcher = DeadRankLauncher()
    handle = ClusterHandle(cluster=cluster, launcher=launcher,
                           monitor=RankMonitor(cluster, launcher, interval_s=0.01).start())
    try:
        assert describing.wait(timeout=5)
        fault = _cluster_fault(handle, RuntimeError("rank 1 (worker) was killed by signal 9"))
    finally:
        handle.monitor.stop()
    assert fault is not None and (fault.rank, fault.exit_code) == (1, -signal.SIGKILL)
    assert len(handle.monitor.failures) == 1


def test_monitor_names_the_killed_rank_before_the_peer_that_aborted_because_of_it(tmp_path):
    cluster, launcher = make_cluster(tmp_path), LocalLauncher()
    # Rank 0 aborts as soon as rank 1 is gone, as a JAX rank does when its peer vanishes mid-collective.
    follower = [sys.executable, "-c", "import os, sys, time\nwhile os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
                "os.abort()", str(tmp_path / "peer-alive")]
    (tmp_path / "peer-alive").touch()
    launcher.start(cluster, "coordinator", 0, follower, dict(os.environ), {}, "rank0")
    launcher.start(cluster, "worker", 1, [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ),
                   {}, "rank1")
    monitor = RankMonitor(cluster, launcher, interval_s=3600)  # polled by hand: both deaths in one pass
    try:
        os.kill(cluster.rank(1).pid, signal.SIGKILL)
        (tmp_path / "peer-alive").unlink()
        deadline = time.monotonic() + 10
        while any(launcher.exit_code(r) is None for r in cluster.processes) and time.monotonic() < deadline:
            time.sleep(0.05)
        first = monitor.poll()
        assert (first.rank, first.exit_code) == (1, -signal.SIGKILL)
        assert [(f.rank, f.exit_code) for f in monitor.failures] == [(1, -signal.SIGKILL), (0, -signal.SIGABRT)]
    finally:
        launcher.stop(cluster, grace_s=1.0)


def test_task_retries_skip_cluster_faults_but_not_other_errors():
    """A task retry runs on the same cluster: useless after a dead rank or a hung request (and a
    hung save would cost another step_timeout_s), so only the flow's fresh cluster retries those."""
    from prefect.states import Failed

    from tasks.evaluate_restore import evaluate_restore
    from tasks.save_checkpoint import save_checkpoint
    from txflow.cluster.monitor import Failure, retry_unless_cluster_fault

    died = RankDied(Failure(rank=1, role="worker", exit_code=-9, detected_at=0.0, message="rank 1 died"))
    assert retry_unless_cluster_fault(None, None, Failed(data=died)) is False
    assert retry_unless_cluster_fault(None, None, Failed(data=NoProgress("save made no progress"))) is False
    assert retry_unless_cluster_fault(None, None, Failed(data=OSError("S3 hiccup"))) is True
    for step in (save_checkpoint, evaluate_restore):
        assert step.retries >= 1 and step.retry_condition_fn is retry_unless_cluster_fault


def test_provisioning_is_retried_unless_the_cluster_cannot_be_placed():
    """A port taken meanwhile is worth a second attempt; a placement that does not fit would not fit again."""
    from prefect.states import Failed

    from tasks.provision_coordinator import provision_coordinator
    from txflow.cluster.launcher import PlacementFailed

    retry = provision_coordinator.retry_condition_fn
    assert provision_coordinator.retries >= 1
    assert retry(None, None, Failed(data=PlacementFailed("2 bundles of 1 CPU; the cluster has 1 node"))) is False
    assert retry(None, None, Failed(data=OSError("address already in use"))) is True


def test_an_error_raised_while_a_rank_is_dead_is_that_death(two_ranks):
    """SDK calls that block on their own surface a dead rank as a peer error; inside deaths_first it
    becomes RankDied, which no task retry runs again on the same cluster."""
    cluster, launcher = two_ranks
    handle = ClusterHandle(cluster=cluster, launcher=launcher,
                           monitor=RankMonitor(cluster, launcher, interval_s=3600).start())
    try:
        with pytest.raises(ValueError, match="a plain error"), handle.deaths_first():
            raise ValueError("a plain error")
        os.kill(cluster.rank(1).pid, signal.SIGKILL)
        time.sleep(0.3)
        with pytest.raises(RankDied) as died, handle.deaths_first():
            raise ValueError("Gloo all-reduce failed: Connection closed by peer")
        assert died.value.failure.rank == 1 and died.value.failure.abandoned_at is not None
    finally:
        handle.monitor.stop()


def test_a_session_opened_on_a_cluster_whose_process_died_is_abandoned_as_that_death(tmp_path):
    # Seen when a shared cluster was killed under a run: with its API gone, the SDK's ServiceClient retried
    # for ~60 s before it failed, and only then did the run retry.
    cluster = make_cluster(tmp_path)  # its API port (1) answers nothing
    cluster.processes = [ProcessRecord(role=role, rank=rank, pid=pid, pgid=pid, host="127.0.0.1", log="")
                         for role, rank, pid in (("coordinator", 0, 10**7), ("worker", 1, 10**7 + 1))]
    launcher = DeadRankLauncher()
    handle = ClusterHandle(cluster=cluster, launcher=launcher,
                           monitor=RankMonitor(cluster, launcher, interval_s=0.01).start())
    try:
        with pytest.raises(RankDied) as died:
            handle.service_client(timeout_s=600)
        assert died.value.failure.rank == 1
    finally:
        handle.monitor.stop()
