"""Fault tolerance end to end: a rank killed mid-training is detected within
seconds, the cluster is rebuilt and training resumes from the last durable
state; two runs side by side do not collide."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import alive_pids, cluster_pids, txflow_cmd
from txflow.processes import is_alive

pytestmark = pytest.mark.e2e


def start_run(tmp_path: Path, env: dict, run_id: str, *extra: str) -> tuple[subprocess.Popen, Path, object]:
    state = tmp_path / run_id
    out = open(tmp_path / f"{run_id}.json", "w")
    err = open(tmp_path / f"{run_id}.log", "w")
    proc = subprocess.Popen(txflow_cmd("run", "sft", "--run-id", run_id, "--state-dir", str(state),
                                       "--checkpoints", str(tmp_path / "ckpt"), "--json", *extra),
                            env=env, cwd=tmp_path, stdout=out, stderr=err)
    return proc, state, (out, err)


def wait_for_steps(proc: subprocess.Popen, state: Path, steps: int, log: Path, timeout: float = 400) -> None:
    metrics = state / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"fewer than {steps} steps after {timeout} s"
        time.sleep(0.2)


def finish(proc: subprocess.Popen, files, timeout: float = 600) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for f in files:
            f.close()


@pytest.mark.parametrize("victim", [1, 0], ids=["worker", "rank0"])
def test_killed_rank_is_detected_and_the_run_resumes_on_a_fresh_cluster(tmp_path, txflow_env, reaper, victim):
    run_id = f"kill-rank{victim}"
    proc, state, files = start_run(tmp_path, txflow_env, run_id, "--steps", "14", "--save-every", "4")
    reaper.watch(state)
    try:
        wait_for_steps(proc, state, 6, tmp_path / f"{run_id}.log")
        first_cluster = cluster_pids(state)
        pid = next(p["pid"] for p in json.loads((state / "cluster.json").read_text())["processes"]
                   if p["rank"] == victim)
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
    finally:
        code = finish(proc, files)
    log = (tmp_path / f"{run_id}.log").read_text()
    assert code == 0, log[-4000:]
    report = json.loads((tmp_path / f"{run_id}.json").read_text())
    assert report["status"] == "passed"
    [failure] = report["failures"]
    assert failure["rank"] == victim and failure["exit_code"] == -signal.SIGKILL
    assert 0 <= failure["detected_at"] - killed_at < 5
    assert failure["resumed_from_step"] >= 4 and report["resumed_from_step"] == failure["resumed_from_step"]
    assert report["metrics"][-1]["step"] == 14 and report["restore"]["passed"]
    # Each dead process is logged once, not every interval. (A rank whose peer vanished
    # mid-collective may abort as well, and is then logged once too.)
    deaths = re.findall(r"dead process detected: rank (\d+) .*?, pid (\d+),", log)
    assert (str(victim), str(pid)) in deaths and len(set(deaths)) == len(deaths), deaths
    assert [pid for pid, started in first_cluster if is_alive(pid, started)] == []
    assert alive_pids(state) == []


def test_two_runs_at_once_do_not_collide(tmp_path, txflow_env, reaper):
    runs = [start_run(tmp_path, txflow_env, run_id, "--steps", "6", "--save-every", "0")
            for run_id in ("left", "right")]
    for _, state, _ in runs:
        reaper.watch(state)
    codes = [finish(proc, files, timeout=900) for proc, _, files in runs]
    reports = [json.loads((tmp_path / f"{run_id}.json").read_text()) for run_id in ("left", "right")]
    assert codes == [0, 0], [(tmp_path / f"{r}.log").read_text()[-2000:] for r in ("left", "right")]
    assert [r["run_id"] for r in reports] == ["left", "right"]
    assert all(r["status"] == "passed" for r in reports)
    assert reports[0]["checkpoint_root"] != reports[1]["checkpoint_root"]
    urls = [{a["url"] for a in r["artifacts"]} for r in reports]
    assert not urls[0] & urls[1]
    ports = [json.loads((state / "cluster.json").read_text())["api_port"] for _, state, _ in runs]
    assert ports[0] != ports[1]
    for _, state, _ in runs:
        assert alive_pids(state) == []
