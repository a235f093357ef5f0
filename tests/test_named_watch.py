"""What an attached run's monitor names when a named cluster dies (txflow.cluster.named._Watch), with a fake
launcher: the death the holder saw, not the processes its stop then ended. The real thing, on Ray:
tests/test_ray_e2e.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from txflow.cluster import named
from txflow.cluster.launcher import LostProcess
from txflow.cluster.monitor import RankMonitor
from txflow.cluster.records import Cluster, ProcessRecord
from txflow.processes import procfs


class FakeLauncher:
    """Exit codes by rank; a rank mapped to LostProcess is out of reach (its actor killed)."""

    name = "fake"

    def __init__(self, codes: dict):
        self.codes = codes

    def exit_code(self, record):
        code = self.codes.get(record.rank)
        if isinstance(code, type) and issubclass(code, Exception):
            raise code(f"its actor for rank {record.rank} is gone")
        return code

    def tail(self, record, lines=30):
        return ""


@pytest.fixture
def cluster_of(tmp_path, monkeypatch):
    monkeypatch.setenv(named.CLUSTERS_DIR_ENV, str(tmp_path))

    def make(holder_pid: int, failure: dict | None) -> tuple[named.Serves, Cluster]:
        (tmp_path / "warm").mkdir()
        serves = named.Serves(name="warm", launcher="ray", base_model="tiny", base_model_path="x", max_lora_rank=32,
                              lora_adapters=8, processes=2, base_url="http://127.0.0.1:1", sqlite=True,
                              holder_pid=holder_pid, holder_start_time=procfs.start_time(holder_pid), state="up")
        named._save_serves(serves)
        if failure is not None:  # what the holder writes once it sees a death, before it stops the rest
            named._save_serves(serves.model_copy(update={"failure": failure}))
        records = [ProcessRecord(role="api", rank=None, pid=1, host="h", log="api.log"),
                   ProcessRecord(role="coordinator", rank=0, pid=2, host="h", log="rank0.log"),
                   ProcessRecord(role="worker", rank=1, pid=3, host="h", log="rank1.log")]
        cluster = Cluster(run_id="warm", launcher="ray", state_dir=str(tmp_path / "warm"), host="h", api_port=1,
                          coordinator_port=None, num_processes=2, base_model_path="x", checkpoints_base="y",
                          processes=records)
        return serves, cluster

    return make


def first_failure(serves, cluster, codes):
    monitor = RankMonitor(cluster, named._Watch(serves, FakeLauncher(codes)))
    monitor.poll()
    return monitor.first_failure()


RANK1_KILLED = {"rank": 1, "role": "worker", "exit_code": -signal.SIGKILL,
                "message": "rank 1 (worker), pid 3, was killed by signal 9."}


def test_the_death_the_holder_saw_is_named_not_the_ranks_its_stop_ended(cluster_of):
    serves, cluster = cluster_of(os.getpid(), RANK1_KILLED)
    # The holder's stop ran: rank 0 and the API got its SIGTERM, rank 1's actor is gone already.
    failure = first_failure(serves, cluster, {None: -signal.SIGTERM, 0: -signal.SIGTERM, 1: LostProcess})
    assert (failure.rank, failure.exit_code) == (1, -signal.SIGKILL)


def test_once_the_holder_is_gone_too_its_cause_is_still_named(cluster_of):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    serves, cluster = cluster_of(gone.pid, RANK1_KILLED)
    assert first_failure(serves, cluster, {}).rank == 1


def test_without_a_cause_from_the_holder_deaths_are_named_as_found(cluster_of):
    serves, cluster = cluster_of(os.getpid(), None)
    failure = first_failure(serves, cluster, {None: None, 0: -signal.SIGTERM, 1: None})
    assert (failure.rank, failure.exit_code) == (0, -signal.SIGTERM)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    serves = serves.model_copy(update={"holder_pid": gone.pid, "holder_start_time": None})
    failure = first_failure(serves, cluster, {})
    assert failure.rank == 0 and f"holder of cluster warm (pid {gone.pid}) is gone" in failure.message
