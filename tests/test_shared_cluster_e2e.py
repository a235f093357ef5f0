"""One warm cluster, many runs (issue 34), on one real toy cluster that every test here shares:
`txflow cluster up/status/down`, runs that attach (`--cluster`) and leave it up, two runs' keys kept
apart on the real API, a neighbour's bad request and its failed client, sweeps (a refused grid, two members
side by side ranked and the best promoted, a sweep interrupted), and, last, the cluster killed under an
attached run, which resumes on the restarted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import new_prefect_home, run_txflow, txflow_cmd

pytestmark = [pytest.mark.e2e, pytest.mark.together, pytest.mark.heavy(5)]

NAME = "shared"
ADAPTERS = 24


def start_cluster(env: dict, work: Path, log: Path) -> subprocess.Popen:
    """`txflow cluster up` in the background (it holds the cluster); returns once it is up."""
    holder = subprocess.Popen(txflow_cmd("cluster", "up", NAME, "--base-model", "tiny", "--processes", "1",
                                         "--lora-adapters", str(ADAPTERS)), env=env, cwd=work,
                              stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    serves = Path(env["TXFLOW_CLUSTERS_DIR"]) / NAME / "serves.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if holder.poll() is not None:
            raise AssertionError(f"cluster up exited {holder.returncode}: {log.read_text()[-3000:]}")
        if serves.exists() and json.loads(serves.read_text())["state"] == "up":
            return holder
        time.sleep(0.2)
    raise AssertionError(f"cluster not up in 300 s: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def shared(tmp_path_factory, prefect_db):
    from txflow.cluster.launchers import stop_cluster

    work = tmp_path_factory.mktemp("shared")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(new_prefect_home(work / "prefect-home", prefect_db)), DO_NOT_TRACK="1",
               TINKER_TELEMETRY="0", PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1",
               TXFLOW_CLUSTERS_DIR=str(work / "clusters"))
    previous = os.environ.get("TXFLOW_CLUSTERS_DIR")
    os.environ["TXFLOW_CLUSTERS_DIR"] = env["TXFLOW_CLUSTERS_DIR"]  # named.* in this process sees it too
    holders = [start_cluster(env, work, work / "up.log")]
    try:
        yield {"env": env, "work": work, "holders": holders, "dir": work / "clusters" / NAME}
    finally:
        run_txflow(["cluster", "down", NAME], env, work, timeout=60)
        for holder in holders:
            if holder.poll() is None:
                holder.kill()
            holder.wait(timeout=30)
        stop_cluster(work / "clusters" / NAME, grace_s=1.0)
        if previous is None:
            os.environ.pop("TXFLOW_CLUSTERS_DIR", None)
        else:
            os.environ["TXFLOW_CLUSTERS_DIR"] = previous


def status(shared) -> dict:
    result = run_txflow(["cluster", "status", NAME, "--json"], shared["env"], shared["work"], timeout=60)
    return json.loads(result.stdout)


def wait_for(condition, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout_s} s")


def test_the_cluster_says_what_it_serves_and_where(shared):
    found = status(shared)
    assert found["healthy"] and found["state"] == "up"
    assert (found["base_model"], found["lora_adapters"], found["max_lora_rank"]) == ("tiny", ADAPTERS, 32)
    assert found["free_slots"] == ADAPTERS - 1 and found["attached_runs"] == []
    assert httpx.get(f"{found['base_url']}/api/v1/healthz").status_code == 200
    # A second `up` of the same name is refused in one line; nothing else starts.
    again = run_txflow(["cluster", "up", NAME, "--base-model", "tiny"], shared["env"], shared["work"], timeout=60)
    assert again.returncode == 2 and "is up already" in again.stderr


def attached(run_id: str):
    from txflow.cluster import named
    from txflow.config import RunConfig

    cfg = RunConfig(run_id=run_id, base_model="tiny", cluster=NAME, startup_timeout_s=30).resolved()
    return cfg, named.verify(cfg, named.attach(cfg))


def test_each_runs_key_opens_only_its_own_work_and_release_frees_it(shared):
    """Two runs on the cluster: B's key gets 403 on A's model, session and checkpoints; B's bad request and
    its dropped client leave A training; A's release unloads its model, revokes its key, keeps the cluster."""
    import tinker

    from txflow.cluster import named
    from txflow.training.clients import lora_client
    from txflow.upstream.skyrl_tx import layout

    cfg_a, a = attached("iso-a")
    cfg_b, b = attached("iso-b")
    base = a.cluster.base_url
    key_a, key_b = a.cluster.api_key.get_secret_value(), b.cluster.api_key.get_secret_value()
    assert key_a != key_b
    client_a = lora_client(a, a.service_client(), 8, 60)
    model_a, session_a = client_a.model_id, a.clients[0].holder.get_session_id()
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([1, 2, 3, 4]),
                               loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0, 1.0, 1.0, 1.0]})
    first = a.wait(client_a.forward_backward([datum], "cross_entropy"), "forward_backward", 120)

    def as_b(method, path, body=None):
        return httpx.request(method, f"{base}{path}", json=body, headers={"X-API-Key": key_b}, timeout=30)

    assert as_b("POST", "/api/v1/get_info", {"model_id": model_a, "type": "get_info"}).status_code == 403
    assert as_b("POST", "/api/v1/unload_model", {"model_id": model_a, "type": "unload_model"}).status_code == 403
    assert as_b("POST", "/api/v1/session_heartbeat", {"session_id": session_a,
                                                      "type": "session_heartbeat"}).status_code == 403
    assert as_b("GET", f"/api/v1/training_runs/{model_a}/checkpoints").status_code == 403
    assert as_b("GET", "/api/v1/training_runs").status_code == 403
    own = httpx.post(f"{base}/api/v1/get_info", json={"model_id": model_a, "type": "get_info"},
                     headers={"X-API-Key": key_a}, timeout=30)
    assert own.status_code == 200
    # B, on its own model: a request the cluster cannot serve, then its client dropped without a goodbye.
    client_b = lora_client(b, b.service_client(), 8, 60)
    with pytest.raises(Exception, match="stable_reinforce"):
        b.wait(client_b.forward_backward([datum], "stable_reinforce"), "a bad forward_backward", 120)
    b.close_clients()
    second = a.wait(client_a.forward_backward([datum], "cross_entropy"), "forward_backward", 120)
    assert second.metrics and first.metrics  # A trains on
    path = a.wait(client_a.save_state("iso-a-state"), "save_state", 120).path
    assert as_b("POST", "/api/v1/load_weights", {"model_id": client_b.model_id, "path": path,
                                                "type": "load_weights"}).status_code == 403
    # A's teardown: its model unloaded, its staging gone, its key revoked; the cluster stays up for B.
    named.release(a)
    db = named.database_url(named.load_serves(NAME))
    wait_for(lambda: model_a not in named.loaded_models(db), 60, "A's model unloaded")
    assert not (Path(a.cluster.checkpoints_base) / layout.relative_checkpoint_path(path)).exists()
    refused = httpx.post(f"{base}/api/v1/get_info", json={"model_id": model_a, "type": "get_info"},
                         headers={"X-API-Key": key_a}, timeout=30)
    assert refused.status_code == 401
    assert status(shared)["attached_runs"] == ["iso-b"]
    named.release(b)
    wait_for(lambda: status(shared)["free_slots"] == ADAPTERS - 1, 60, "every slot free again")
    assert status(shared)["healthy"] and status(shared)["attached_runs"] == []


def test_an_attached_run_trains_on_the_warm_cluster_and_leaves_it_up(shared):
    work = shared["work"]
    result = run_txflow(["run", "sft", "--base-model", "tiny", "--cluster", NAME, "--steps", "4", "--run-id",
                         "attached-1", "--checkpoints", str(work / "ckpt"), "--state-dir", str(work / "attached-1"),
                         "--no-export", "--json"], shared["env"], work)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["status"] == "passed" and report["restore"]["passed"]
    assert report["cluster"]["ranks"] == []  # teardown stopped nothing
    # Orchestration from a ready cluster to the train step: attach and verify.
    attach_s = report["timings_s"]["provision-coordinator"] + report["timings_s"]["launch-workers"]
    print(f"attach and verify: {attach_s:.3f} s")
    assert not (work / "attached-1" / "cluster.json").exists()
    found = wait_for(lambda: (s := status(shared))["free_slots"] == ADAPTERS - 1 and s, 60, "slots released")
    assert found["healthy"] and found["attached_runs"] == []
    assert json.loads((shared["dir"] / "run-keys.json").read_text()) == {}


def test_a_sweep_member_over_the_clusters_rank_refuses_the_sweep_before_anything_starts(shared):
    work = shared["work"]
    result = run_txflow(["sweep", "sft", "--base-model", "tiny", "--cluster", NAME, "--lora-rank", "8,64",
                         "--sweep-id", "refused", "--checkpoints", str(work / "ckpt")], shared["env"], work,
                        timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"txflow: --cluster {NAME} takes LoRA ranks up to 32, not --lora-rank 64"], result.stderr[-3000:]
    assert not list((work / "ckpt").glob("refused-*")) and not (work / ".txflow" / "sweeps" / "refused").exists()


def test_a_sweep_trains_its_members_side_by_side_ranks_them_and_promotes_the_best(shared):
    """Two members on the shared cluster: one learns, one at a learning rate far too high fails its check,
    and only itself; the ranking names both, the best is promoted, and every slot and key is freed."""
    work = shared["work"]
    result = run_txflow(["sweep", "sft", "--base-model", "tiny", "--cluster", NAME, "--learning-rate", "2e-2,50",
                         "--steps", "4", "--sweep-id", "sw", "--checkpoints", str(work / "ckpt"), "--state-dir",
                         str(work / "sweep"), "--promote-best-as", "best", "--json"], shared["env"], work)
    assert result.returncode == 1, result.stderr[-3000:]  # one member failed
    ranking = json.loads(result.stdout)
    assert ranking == json.loads((work / "sweep" / "ranking.json").read_text())
    rows = {r["run_id"]: r for r in ranking["members"]}
    assert [r["run_id"] for r in ranking["members"]] == ["sw-00", "sw-01"]
    good, bad = rows["sw-00"], rows["sw-01"]
    assert (good["status"], good["rank"], good["learning_rate"]) == ("passed", 1, 2e-2)
    assert ranking["best"] == "sw-00" and ranking["ranked_by"] == "final_eval_loss" and ranking["failed"] == ["sw-01"]
    assert (bad["status"], bad["rank"], bad["learning_rate"]) == ("failed", None, 50)
    assert bad["error"].startswith("checks failed: SFT held-out gain")
    # Each member is a full run with its own report, checkpoints and proofs; the figures are its report's.
    reports = {r: json.loads((work / "ckpt" / r / "report.json").read_text()) for r in rows}
    assert reports["sw-00"]["status"] == "passed" and reports["sw-01"]["status"] == "failed"
    assert good["figure"] == reports["sw-00"]["restore"]["final_eval_loss"] < reports["sw-00"]["restore"][
        "base_eval_loss"]
    assert {reports[r]["learning_rate"] for r in rows} == {2e-2, 50}
    assert reports["sw-00"]["export"]["passed"] and reports["sw-01"]["export"] is None
    # The members ran side by side: each started before the other finished.
    spans = [(r["finished_at"] - r["timings_s"]["total"], r["finished_at"]) for r in reports.values()]
    assert max(start for start, _ in spans) < min(end for _, end in spans), spans
    promoted = json.loads(run_txflow(["promoted", str(work / "ckpt"), "best", "--json"], shared["env"], work,
                                     timeout=60).stdout)["current"]
    assert promoted["run_id"] == "sw-00" and promoted["sweep"] == {"ranked_by": "final_eval_loss", "members": 2}
    assert "| 1 | sw-00 | 0.02 | 32 | passed |" in (work / "sweep" / "ranking.md").read_text()
    found = wait_for(lambda: (s := status(shared))["free_slots"] == ADAPTERS - 1 and s, 60, "slots released")
    assert found["healthy"] and found["attached_runs"] == []
    assert json.loads((shared["dir"] / "run-keys.json").read_text()) == {}


def test_an_interrupted_sweep_stops_its_runs_and_leaves_the_cluster_serving(shared):
    """SIGTERM to `txflow sweep` mid-training: each member (a thread of that process) is interrupted as a
    cancelled run is and releases its part; the command exits within seconds, the cluster stays healthy with
    every slot free and no member's key left."""
    work = shared["work"]
    proc = subprocess.Popen(txflow_cmd("sweep", "sft", "--base-model", "tiny", "--cluster", NAME, "--learning-rate",
                                       "1e-2,2e-2", "--steps", "400", "--save-every", "0", "--sweep-id", "cut",
                                       "--checkpoints", str(work / "ckpt"), "--state-dir", str(work / "cut"),
                                       "--no-export"), env=shared["env"], cwd=work, stdout=subprocess.DEVNULL,
                            stderr=open(work / "cut.log", "w"))
    try:
        metrics = [work / "cut" / f"cut-0{i}" / "metrics.jsonl" for i in range(2)]
        wait_for(lambda: all(m.exists() and m.read_text().strip() for m in metrics), 180, "both members training")
        os.kill(proc.pid, signal.SIGTERM)
        began = time.monotonic()
        code = proc.wait(timeout=90)
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (work / "cut.log").read_text()
    assert code != 0 and "sweep interrupted: stopping its 2 runs" in log, log[-3000:]
    print(f"sweep exited {took:.1f} s after SIGTERM")
    steps = [len(m.read_text().splitlines()) for m in metrics]
    assert all(n < 400 for n in steps), steps  # stopped, not run to the end
    assert json.loads((shared["dir"] / "run-keys.json").read_text()) == {}
    assert status(shared)["healthy"]
    # Each member tore down as a cancelled run does: its models unloaded by its own release (the engine would
    # free them only minutes after their sessions' last heartbeat).
    wait_for(lambda: status(shared)["free_slots"] == ADAPTERS - 1, 15, "the members' slots freed")
    assert log.count("the run's key revoked; the cluster stays up") == 2, log[-3000:]


def test_a_killed_cluster_is_named_and_the_run_resumes_on_the_restarted_one(shared):
    work, env = shared["work"], shared["env"]
    state = work / "survivor"
    run = subprocess.Popen(txflow_cmd("run", "sft", "--base-model", "tiny", "--cluster", NAME, "--steps", "40",
                                      "--save-every", "5", "--run-id", "survivor", "--checkpoints",
                                      str(work / "ckpt"), "--state-dir", str(state), "--no-export",
                                      "--startup-timeout", "240", "--json"),
                           env=env, cwd=work, stdout=subprocess.PIPE, stderr=open(work / "survivor.log", "w"),
                           text=True)
    try:
        metrics = state / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 7, 300, "step 7")
        holder = shared["holders"][-1]
        holder.send_signal(signal.SIGKILL)  # the cluster's processes die with their holder
        killed_at = time.time()
        holder.wait(timeout=30)
        shared["holders"].append(start_cluster(env, work, work / "up-again.log"))
        out, _ = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, (work / "survivor.log").read_text()[-3000:]
    report = json.loads(out)
    assert report["status"] == "passed"
    failure = report["failures"][0]
    assert f"cluster {NAME}" in failure["message"]
    assert failure["detected_at"] - killed_at < 5
    assert report["resumed_from_step"] >= 5 and failure["resumed_from_step"] >= 5
