"""The flow's cancellation / crash hook alone: it stops a cluster whose flow process is gone, from
cluster.json, and says in the run's log what it stopped."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import uuid

from prefect.client.schemas.objects import FlowRun
from prefect.settings import PREFECT_LOGGING_TO_API_ENABLED, temporary_settings
from prefect.states import Cancelling, Crashed

from flows.train import _stop_cluster_hook, train_flow
from txflow.processes.procfs import is_alive

# A "flow process" that starts a cluster of two processes (as the local launcher does) and exits
# without stopping them; the processes do not watch their parent, as a pre-lifeline rank would not.
FLOW_PROCESS = textwrap.dedent("""
    import json, os, sys
    from txflow.cluster.records import Cluster
    from txflow.cluster.launchers.local import LocalLauncher
    state = sys.argv[1]
    os.makedirs(state + "/logs", exist_ok=True)
    cluster = Cluster(run_id="hooked", launcher="local", state_dir=state, host="127.0.0.1", api_port=1,
                      coordinator_port=None, num_processes=1, base_model_path="x", checkpoints_base="y")
    sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
    env = {k: v for k, v in os.environ.items()}
    LocalLauncher().start(cluster, "api", None, sleeper, env, {}, "api")
    LocalLauncher().start(cluster, "coordinator", 0, sleeper, env, {}, "rank0")
""")


def test_the_hook_stops_a_cluster_whose_flow_process_is_gone_and_says_what_it_stopped(tmp_path, caplog, reaper):
    state = reaper.watch(tmp_path / "state")
    subprocess.run([sys.executable, "-c", FLOW_PROCESS, str(state)], check=True, timeout=60)
    records = json.loads((state / "cluster.json").read_text())["processes"]
    assert len(records) == 2 and all(is_alive(r["pid"], r["start_time"]) for r in records)

    flow_run = FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="hooked-run",
                       parameters={"config": {"mode": "sft", "run_id": "hooked", "state_dir": str(state)}})
    caplog.set_level(logging.INFO)
    with temporary_settings(updates={PREFECT_LOGGING_TO_API_ENABLED: False}):
        _stop_cluster_hook(train_flow, flow_run, Crashed())

    assert not any(is_alive(r["pid"], r["start_time"]) for r in records)
    [line] = [r.getMessage() for r in caplog.records if "hook: stopped the cluster" in r.getMessage()]
    assert line.startswith(f"Crashed hook: stopped the cluster in {state}: ")
    assert all(f"pid {r['pid']} exit" in line for r in records)


def test_the_hook_with_nothing_recorded_says_so(tmp_path, caplog):
    flow_run = FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="empty-run",
                       parameters={"config": {"mode": "sft", "run_id": "empty", "state_dir": str(tmp_path / "s")}})
    caplog.set_level(logging.INFO)
    with temporary_settings(updates={PREFECT_LOGGING_TO_API_ENABLED: False}):
        _stop_cluster_hook(train_flow, flow_run, Cancelling())
    assert any("Cancelling hook: stopped the cluster" in r.getMessage() and r.getMessage().endswith("nothing recorded")
               for r in caplog.records)


def test_the_hook_stops_the_cluster_when_prefect_masked_the_run_secrets(tmp_path, caplog, reaper):
    # TINKER_API_KEY, a database URL and storage options reach Prefect as secrets: it keeps "**********".
    state = reaper.watch(tmp_path / "state")
    subprocess.run([sys.executable, "-c", FLOW_PROCESS, str(state)], check=True, timeout=60)
    records = json.loads((state / "cluster.json").read_text())["processes"]
    masked = "*" * 10
    flow_run = FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="masked-run",
                       parameters={"config": {"mode": "sft", "run_id": "masked", "state_dir": str(state),
                                              "api_key": masked, "database_url": masked,
                                              "storage_options": {"key": masked}}})
    caplog.set_level(logging.INFO)
    with temporary_settings(updates={PREFECT_LOGGING_TO_API_ENABLED: False}):
        _stop_cluster_hook(train_flow, flow_run, Crashed())
    assert not any(is_alive(r["pid"], r["start_time"]) for r in records)


def test_the_hook_of_a_run_that_fell_back_to_its_own_cluster_stops_it_and_revokes_its_shared_key(
        tmp_path, caplog, reaper, monkeypatch):
    # With `cluster_fallback` own the run's parameters still name the shared cluster, while the processes to stop
    # are those of the cluster of its own, recorded in its state directory.
    state = reaper.watch(tmp_path / "state")
    subprocess.run([sys.executable, "-c", FLOW_PROCESS, str(state)], check=True, timeout=60)
    records = json.loads((state / "cluster.json").read_text())["processes"]
    monkeypatch.setenv("TXFLOW_CLUSTERS_DIR", str(tmp_path / "clusters"))
    (tmp_path / "clusters" / "warm").mkdir(parents=True)
    keys = tmp_path / "clusters" / "warm" / "run-keys.json"
    neighbour = {"owner": "neighbour", "kind": "run", "pid": None}
    keys.write_text(json.dumps({"digest-of-its-key": {"owner": "hooked", "kind": "run"},
                                "digest-of-another": neighbour}))
    flow_run = FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="fell-back-run",
                       parameters={"config": {"mode": "sft", "run_id": "hooked", "state_dir": str(state),
                                              "cluster": "warm", "cluster_fallback": "own"}})
    caplog.set_level(logging.INFO)
    with temporary_settings(updates={PREFECT_LOGGING_TO_API_ENABLED: False}):
        _stop_cluster_hook(train_flow, flow_run, Cancelling())
    assert not any(is_alive(r["pid"], r["start_time"]) for r in records)
    assert json.loads(keys.read_text()) == {"digest-of-another": neighbour}
