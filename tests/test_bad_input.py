"""Bad input: each a clear error before any process starts (table-driven), and the
rank monitor's one-time report of a dead process."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from txflow import preflight, storage
from txflow.cluster import Cluster, LocalLauncher
from txflow.config import RunConfig
from txflow.discovery import write_commit
from txflow.monitor import RankMonitor
from txflow.preflight import PreflightError
from txflow.rewards import RewardError, score


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def orbax_state(root: Path, relative: str, committed: bool) -> str:
    step = root / relative / "checkpoint_0"
    step.mkdir(parents=True)
    for name in ("_CHECKPOINT_METADATA", "_METADATA", "commit_success.txt"):
        (step / name).write_text("{}")
    url = str(root / relative)
    if committed:
        write_commit(url)
    return url


CASES = {
    "missing dataset": (lambda t: {"dataset": str(t / "nope.jsonl")}, "does not exist"),
    "malformed JSONL": (lambda t: {"dataset": write(t / "bad.jsonl", '{"prompt": "a", "completion": "b"}\n{oops\n')},
                        "line 2: not valid JSON"),
    "empty dataset": (lambda t: {"dataset": write(t / "empty.jsonl", "\n\n")}, "has no rows"),
    "prompt longer than the context": (
        lambda t: {"dataset": write(t / "long.jsonl", json.dumps({"prompt": "word " * 2000, "completion": "x"}) + "\n")},
        "longer than the model's context"),
    "rl prompt longer than the context": (
        lambda t: {"mode": "rl", "dataset": write(t / "long.jsonl", json.dumps({"prompt": "word " * 2000}) + "\n")},
        "exceeds the model's context"),
    "reward cannot be imported": (lambda t: {"mode": "rl", "reward": "nowhere_xyz:fn"}, "cannot import module"),
    "invalid fsspec URL": (lambda t: {"checkpoints": "nosuchproto://bucket/x"}, "not a usable fsspec URL"),
    "root not writable": (lambda t: {"checkpoints": write(t / "a-file", "x") + "/sub"}, "cannot write under"),
    "resume from an incomplete checkpoint": (
        lambda t: {"resume_from": orbax_state(t / "old", "m1/step-000004.tar.gz", committed=False)}, "is incomplete"),
    "resume from a root without states": (lambda t: {"resume_from": write(t / "r" / "x.txt", "x").rsplit("/", 1)[0]},
                                          "no complete, committed state"),
    "missing local model": (lambda t: {"base_model": str(t / "no-model")}, "no such directory"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_in_preflight_with_a_clear_message(case, tmp_path):
    fields, message = CASES[case]
    cfg = RunConfig(**{"run_id": "bad", "state_dir": str(tmp_path / "state"), "checkpoints": str(tmp_path / "ckpt"),
                       **fields(tmp_path)}).resolved()
    with pytest.raises(PreflightError, match=message):
        preflight.prepare(cfg)
    assert not (tmp_path / "state" / "cluster.json").exists()


@pytest.mark.parametrize("fields, message", [
    ({"processes": 0}, "at least 1"),
    ({"processes": 2, "mesh": {"fsdp": 3}}, "must equal the device count"),
    ({"mode": "rl", "loss": "reinforce"}, "loss"),
    ({"mode": "dpo"}, "mode"),
    ({"lora_rank": 64, "max_lora_rank": 32}, "above max_lora_rank"),
    ({"api_key": "not-a-tinker-key"}, "tml-"),
])
def test_bad_config_is_rejected_by_the_config_model(fields, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**fields)


def test_resume_from_a_complete_checkpoint_resolves_to_it_and_its_step(tmp_path):
    url = orbax_state(tmp_path / "old", "m1/step-000004.tar.gz", committed=True)
    cfg = RunConfig(run_id="r", state_dir=str(tmp_path / "s"), checkpoints=str(tmp_path / "c"),
                    resume_from=url).resolved()
    assert storage.resolve_resume_from(cfg) == (url, 4)
    newer = orbax_state(tmp_path / "old", "m1/step-000008.tar.gz", committed=True)
    orbax_state(tmp_path / "old", "m1/step-000012.tar.gz", committed=False)
    cfg = cfg.model_copy(update={"resume_from": str(tmp_path / "old")})
    assert storage.resolve_resume_from(cfg) == (newer, 8)  # the latest COMPLETE one


@pytest.mark.parametrize("value", ["0.5", None, float("nan"), True])
def test_reward_that_is_not_a_finite_number_names_the_row(value):
    with pytest.raises(RewardError, match=r"data.jsonl line 3; it must return a finite number"):
        score(lambda *a: value, "mod:fn", "p", "t", [1], {}, "data.jsonl line 3")


def test_monitor_reports_a_dead_rank_once_with_its_exit_code(tmp_path):
    cluster = Cluster(run_id="m", launcher="local", state_dir=str(tmp_path), host="127.0.0.1", api_port=1,
                      coordinator_port=None, num_processes=2, base_model_path="x", checkpoints_base="y")
    (tmp_path / "logs").mkdir()
    launcher = LocalLauncher()
    sleeper = [sys.executable, "-c", "print('rank alive', flush=True); import time; time.sleep(60)"]
    for rank in (0, 1):
        launcher.start(cluster, "coordinator" if rank == 0 else "worker", rank, sleeper, {}, {}, f"rank{rank}")
    monitor = RankMonitor(cluster, launcher, interval_s=0.1).start()
    try:
        time.sleep(0.5)
        assert monitor.failures == []
        killed_at = time.time()
        os.kill(cluster.rank(1).pid, signal.SIGKILL)
        assert monitor.failed.wait(timeout=5)
        time.sleep(0.5)  # several more polls
        [failure] = monitor.failures
        assert (failure.rank, failure.exit_code) == (1, -signal.SIGKILL)
        assert failure.detected_at - killed_at < 1.0
        assert "rank 1 (worker)" in failure.message and "rank alive" in failure.message
    finally:
        monitor.stop()
        launcher.stop(cluster, grace_s=1.0)


class DeadRankLauncher(LocalLauncher):
    """Reports rank 1 as killed by SIGKILL, without starting anything."""

    def exit_code(self, record):
        return -signal.SIGKILL if record.rank == 1 else None


def test_a_death_the_monitor_thread_is_recording_still_counts_as_a_cluster_fault(tmp_path, monkeypatch):
    # Seen in the fault test: the request failed with RankDied while the monitor thread had marked
    # the dead rank seen but not yet recorded it; the flow's own poll found nothing new and failed
    # the run instead of retrying on a fresh cluster.
    from flows.train import _cluster_fault
    from txflow import monitor as monitor_module
    from txflow.cluster import ProcessRecord

    cluster = Cluster(run_id="m", launcher="local", state_dir=str(tmp_path), host="127.0.0.1", api_port=1,
                      coordinator_port=None, num_processes=2, base_model_path="x", checkpoints_base="y")
    cluster.processes = [ProcessRecord(role=role, rank=rank, pid=pid, pgid=pid, host="127.0.0.1", log="")
                         for role, rank, pid in (("coordinator", 0, 10**7), ("worker", 1, 10**7 + 1))]
    describing = threading.Event()
    real_describe = monitor_module.describe_exit

    def slow_describe(record, code):  # the log tail is read between "seen" and "recorded"
        describing.set()
        time.sleep(0.5)
        return real_describe(record, code)

    monkeypatch.setattr(monitor_module, "describe_exit", slow_describe)
    monitor = RankMonitor(cluster, DeadRankLauncher(), interval_s=0.01).start()
    try:
        assert describing.wait(timeout=5)
        fault = _cluster_fault(monitor, RuntimeError("rank 1 (worker) was killed by signal 9"))
    finally:
        monitor.stop()
    assert fault is not None and (fault.rank, fault.exit_code) == (1, -signal.SIGKILL)
    assert len(monitor.failures) == 1


def test_monitor_names_the_killed_rank_before_the_peer_that_aborted_because_of_it(tmp_path):
    cluster = Cluster(run_id="m", launcher="local", state_dir=str(tmp_path), host="127.0.0.1", api_port=1,
                      coordinator_port=None, num_processes=2, base_model_path="x", checkpoints_base="y")
    (tmp_path / "logs").mkdir()
    launcher = LocalLauncher()
    # Rank 0 aborts as soon as rank 1 is gone, as a JAX rank does when its peer vanishes mid-collective.
    follower = [sys.executable, "-c", "import os, sys, time\nwhile os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
                "os.abort()", str(tmp_path / "peer-alive")]
    (tmp_path / "peer-alive").touch()
    launcher.start(cluster, "coordinator", 0, follower, {}, {}, "rank0")
    launcher.start(cluster, "worker", 1, [sys.executable, "-c", "import time; time.sleep(60)"], {}, {}, "rank1")
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
