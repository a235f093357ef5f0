"""One warm cluster, many runs, on one real toy cluster that every test here shares:
`txflow cluster up/status/down`, runs that attach (`--cluster`) and leave it up, two runs' keys kept
apart on the real API, a neighbour's bad request, its failed client, the gradient it left without a step, its
cancellation and its SIGKILL, sweeps (a refused grid, two members side by side ranked and the best promoted, the
base model evaluated once for an SFT and an RL sweep's members, a sweep interrupted), and, last, the cluster killed
under two attached runs: one resumes on a cluster of its own, the other on the restarted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import alive_pids, new_prefect_home, run_txflow, txflow_cmd

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
    from txflow.upstream.tiny_model import resolve_base_model

    cfg = RunConfig(run_id=run_id, base_model="tiny", cluster=NAME, startup_timeout_s=30).resolved()
    return cfg, named.verify(cfg, named.attach(cfg, resolve_base_model("tiny")))


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
    # The outside review's bypasses, on the real API: A's checkpoint path in another spelling the routes read,
    # a JSON body under a protobuf-looking Content-Type, a protobuf Content-Type on JSON, two Content-Types.
    for spelling in (path.replace("tinker://", "TINKER://"), " " + path):
        assert as_b("POST", "/api/v1/load_weights", {"model_id": client_b.model_id, "path": spelling,
                                                    "type": "load_weights"}).status_code == 403, spelling
    body = json.dumps({"model_id": model_a, "type": "forward_backward", "forward_backward_input": {
        "data": [datum.model_dump(mode="json")], "loss_fn": "cross_entropy"}}).encode()
    for types, status_code in ((["application/json; profile=protobuf"], 403), (["Application/X-Protobuf"], 400),
                               (["application/json", "application/x-protobuf"], 400)):
        answer = httpx.post(f"{base}/api/v1/forward_backward", content=body, timeout=30,
                            headers=[("X-API-Key", key_b), *(("Content-Type", t) for t in types)])
        assert answer.status_code == status_code, (types, answer.text)
    # A request beyond a bound (3e6 samples once built 188 MiB of ids in the API's event loop): one line.
    flood = as_b("POST", "/api/v1/asample", {"num_samples": 3_000_000, "prompt": {"chunks": []},
                                             "sampling_params": {"max_tokens": 4}, "base_model": "tiny"})
    assert flood.status_code == 400 and flood.json()["detail"] == (
        "num_samples 3000000 is above this cluster's limit 1024 (--api-max-samples)")
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


def test_a_neighbours_weight_decay_leaves_my_adapter_as_it_was(shared):
    """Two runs' adapters on one cluster: A's optimizer steps with AdamW's weight decay, and B's model computes the
    same logprobs, bit for bit, before and after them (`optimizer-own-slot`; upstream's optimizer decayed every
    slot's weights, B's among them, at each of A's steps)."""
    import tinker

    from txflow.cluster import named
    from txflow.training.clients import lora_client

    _, a = attached("decay-a")
    _, b = attached("decay-b")
    try:
        client_a, client_b = (lora_client(h, h.service_client(), 8, 60) for h in (a, b))
        datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([1, 2, 3, 4, 5, 6]),
                                   loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6, 7], "weights": [1.0] * 6})

        def train(handle, client, weight_decay: float) -> None:
            handle.wait(client.forward_backward([datum], "cross_entropy"), "forward_backward", 120)
            handle.wait(client.optim_step(tinker.types.AdamParams(learning_rate=0.1, weight_decay=weight_decay)),
                        "optim_step", 120)

        def logprobs(handle, client) -> list[float]:
            out = handle.wait(client.forward([datum], "cross_entropy"), "forward", 120)
            return out.loss_fn_outputs[0]["logprobs"].tolist()

        train(b, client_b, 0.0)  # B's lora_B is no longer zero: its logprobs depend on every LoRA weight it has
        train(a, client_a, 0.0)
        before_b, before_a = logprobs(b, client_b), logprobs(a, client_a)
        for _ in range(2):
            train(a, client_a, 0.5)
        assert logprobs(a, client_a) != before_a  # A trained
        assert logprobs(b, client_b) == before_b  # B's adapter is as it was
    finally:
        named.release(a)
        named.release(b)
    wait_for(lambda: status(shared)["free_slots"] == ADAPTERS - 1, 60, "every slot free again")


def test_a_gradient_left_without_its_step_never_reaches_the_next_model_in_its_slot(shared):
    """X's model is unloaded between its forward_backward and its optimizer step (as a run killed mid-step is):
    Y's model, created next in X's slot, trains to the same logprobs as Z's, of the same seed and data in a slot X
    never had (`fresh-slot-gradient`; upstream took X's gradient into Y's first step, so a run's figures depended
    on the slot it got)."""
    import tinker

    from txflow.cluster import named
    from txflow.training.clients import lora_client

    def datum(tokens: list[int]):
        return tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                                  loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})

    _, x = attached("left-x")
    try:
        client_x = lora_client(x, x.service_client(), 8, 60, seed=0)
        x.wait(client_x.forward_backward([datum([9, 40, 7, 81, 3, 66, 12])], "cross_entropy"), "forward_backward",
               120)
    finally:
        named.release(x)
    wait_for(lambda: status(shared)["free_slots"] == ADAPTERS - 1, 60, "X's slot free again")
    mine = datum([1, 2, 3, 4, 5, 6, 7])
    _, y = attached("left-y")
    _, z = attached("left-z")
    try:
        learned = []
        for handle in (y, z):  # Y first: the lowest free slot, X's
            client = lora_client(handle, handle.service_client(), 8, 60, seed=0)
            handle.wait(client.forward_backward([mine], "cross_entropy"), "forward_backward", 120)
            handle.wait(client.optim_step(tinker.types.AdamParams(learning_rate=0.1)), "optim_step", 120)
            out = handle.wait(client.forward([mine], "cross_entropy"), "forward", 120)
            learned.append(out.loss_fn_outputs[0]["logprobs"].tolist())
    finally:
        named.release(y)
        named.release(z)
    assert learned[0] == learned[1]
    wait_for(lambda: status(shared)["free_slots"] == ADAPTERS - 1, 60, "every slot free again")


def start_run(shared, run_id: str, *args: str, hold_at: str = "") -> subprocess.Popen:
    """`txflow run sft` attached to the shared cluster, in the background; its report on stdout, its log in
    `<work>/<run_id>.log`, its state in `<work>/<run_id>/`; `hold_at`: a hold point (txflow.processes.holds) it
    stops at, its files in `<work>/<run_id>-holds/`."""
    work = shared["work"]
    holds = work / f"{run_id}-holds"
    holds.mkdir(exist_ok=True)
    env = shared["env"] | {"TXFLOW_HOLD_AT": hold_at, "TXFLOW_HOLD_DIR": str(holds)}
    with open(work / f"{run_id}.log", "w") as log:
        return subprocess.Popen(txflow_cmd("run", "sft", "--base-model", "tiny", "--cluster", NAME, "--run-id", run_id,
                                           "--checkpoints", str(work / "ckpt"), "--state-dir", str(work / run_id),
                                           "--no-export", "--json", *args),
                                env=env, cwd=work, stdout=subprocess.PIPE, stderr=log, text=True)


def steps_done(shared, run_id: str) -> int:
    metrics = shared["work"] / run_id / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def stop_if_running(*runs: subprocess.Popen | None) -> None:
    for run in runs:
        if run is not None and run.poll() is None:
            run.kill()
            run.wait(timeout=30)


def interrupted(run: subprocess.Popen, log: Path, timeout_s: float = 90) -> None:
    """SIGTERM to `txflow run` or `txflow sweep`: it exits 143 (128 + SIGTERM) within `timeout_s`, saying so. One
    that does not is asked for its threads' stacks (SIGUSR1) and the test fails with its log's tail."""
    run.send_signal(signal.SIGTERM)
    try:
        code = run.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        run.send_signal(signal.SIGUSR1)
        time.sleep(2)
        raise AssertionError(f"still running {timeout_s:.0f} s after SIGTERM: {log.read_text()[-12000:]}") from None
    assert code == 128 + signal.SIGTERM and "txflow: interrupted (SIGTERM)" in log.read_text(), log.read_text()[-3000:]


def test_a_run_cancelled_beside_another_is_released_at_once_and_the_other_trains_on_and_passes(shared):
    """Two runs attach and train side by side; one is cancelled mid-training as a user cancels (SIGTERM to
    `txflow run`, which takes Ctrl-C's path): its models are unloaded and its key revoked by its own teardown,
    within seconds (not when the engine times its sessions out), the cluster stays healthy, and the other run
    trains on, passes, and leaves the cluster up with every slot free."""
    from txflow.cluster import named

    work, keys = shared["work"], shared["dir"] / "run-keys.json"
    db = named.database_url(named.load_serves(NAME))
    cancelled = start_run(shared, "cancelled", "--steps", "500")
    survivor = None
    try:
        wait_for(lambda: steps_done(shared, "cancelled") >= 2, 300, "the first run training")
        theirs = set(named.loaded_models(db))  # it is alone on the cluster: every model loaded is its own
        assert theirs
        # The other run, held after its step 2 until the cancel is over: every step after that is trained beside
        # the cancelled run's remains, if any.
        survivor = start_run(shared, "attached-1", "--steps", "8", hold_at="train-step-2")
        held = work / "attached-1-holds" / "train-step-2.held"
        wait_for(lambda: held.exists() or survivor.poll() is not None, 300, "the second run training beside it")
        assert survivor.poll() is None, (work / "attached-1.log").read_text()[-3000:]
        interrupted(cancelled, work / "cancelled.log")
        # Released by its own teardown: the engine would free its slot only 120-180 s after its last heartbeat.
        wait_for(lambda: not theirs & set(named.loaded_models(db)), 15, "the cancelled run's models unloaded")
        assert "cancelled" not in json.loads(keys.read_text()).values()
        found = status(shared)
        assert found["healthy"] and found["attached_runs"] == ["attached-1"]
        (work / "attached-1-holds" / "train-step-2.release").touch()
        out, _ = survivor.communicate(timeout=600)
    finally:
        stop_if_running(cancelled, survivor)
    assert survivor.returncode == 0, (work / "attached-1.log").read_text()[-3000:]
    report = json.loads(out)
    assert report["status"] == "passed" and report["restore"]["passed"] and report["failures"] == []
    assert report["cluster"]["ranks"] == []  # teardown stopped nothing
    # Orchestration from a ready cluster to the train step: attach and verify.
    attach_s = report["timings_s"]["provision-coordinator"] + report["timings_s"]["launch-workers"]
    print(f"attach and verify: {attach_s:.3f} s")
    assert not (work / "attached-1" / "cluster.json").exists()
    found = wait_for(lambda: (s := status(shared))["free_slots"] == ADAPTERS - 1 and s, 60, "slots released")
    assert found["healthy"] and found["attached_runs"] == []
    assert json.loads(keys.read_text()) == {}


def test_a_killed_run_is_released_by_the_clusters_holder_within_seconds(shared):
    """SIGKILL to an attached `txflow run` mid-training (an out-of-memory kill: no code of the run runs): the
    cluster's holder sees its process gone and releases it as its own teardown would have, its models unloaded,
    their staging removed and its key revoked, and `status` no longer lists it. The engine alone would free the
    slot only when the run's session times out, 120-180 s later."""
    from txflow.cluster import named
    from txflow.cluster.records import Cluster

    work, keys = shared["work"], shared["dir"] / "run-keys.json"
    db = named.database_url(named.load_serves(NAME))
    killed = start_run(shared, "killed", "--steps", "500")
    try:
        wait_for(lambda: steps_done(shared, "killed") >= 2, 300, "the run training")
        theirs = set(named.loaded_models(db))  # alone on the cluster: every model loaded is its own
        assert theirs and "killed" in status(shared)["attached_runs"]
        killed.kill()
        killed.wait(timeout=30)
    finally:
        stop_if_running(killed)
    wait_for(lambda: not theirs & set(named.loaded_models(db)), 15, "the killed run's models unloaded")
    assert "killed" not in {r["owner"] for r in json.loads(keys.read_text()).values()}
    staging = Path(Cluster.load(shared["dir"]).checkpoints_base)
    assert not [m for m in theirs if (staging / m).exists()]
    found = status(shared)
    assert found["healthy"] and found["attached_runs"] == [] and found["free_slots"] == ADAPTERS - 1
    assert f"run killed (pid {killed.pid}) is gone without its teardown: {len(theirs)} model(s) unloaded" in (
        work / "up.log").read_text()


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
    # Tracked where a user's runs are by default: MLflow's SQLite store in the working directory's .txflow/.
    env = {k: v for k, v in shared["env"].items() if k != "TXFLOW_TRACKING_URI"}
    result = run_txflow(["sweep", "sft", "--base-model", "tiny", "--cluster", NAME, "--learning-rate", "2e-2,50",
                         "--steps", "4", "--sweep-id", "sw", "--checkpoints", str(work / "ckpt"), "--state-dir",
                         str(work / "sweep"), "--promote-best-as", "best", "--json"], env, work)
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
    # The base model's figures (its greedy tokens and held-out loss) were computed once on the cluster: each by
    # one member, the other took them, whichever came first.
    restores = [reports[r]["restore"] for r in rows]
    for kind in ("greedy_tokens", "eval_loss"):
        assert sum(kind in r.get("shared_base_figures", []) for r in restores) == 1, restores
    assert restores[0]["base_eval_loss"] == restores[1]["base_eval_loss"]
    assert [a["base"] for a in restores[0]["answers"]] == [a["base"] for a in restores[1]["answers"]]
    # The members ran side by side: the sweep started each before the other finished. (Their flows' bodies may
    # not overlap on a loaded machine: Prefect's server took 2-6 s to create the second subflow run while the
    # first member loaded its model, measured, and the failing member is over in 4 s.)
    assert max(r["started_at"] for r in rows.values()) < min(r["finished_at"] for r in rows.values()), rows
    for r in rows.values():  # a member's span holds its run's
        run = reports[r["run_id"]]
        began = run["finished_at"] - run["timings_s"]["total"]
        assert r["started_at"] <= began < run["finished_at"] <= r["finished_at"], (r, run["finished_at"], began)
    promoted = json.loads(run_txflow(["promoted", str(work / "ckpt"), "best", "--json"], shared["env"], work,
                                     timeout=60).stdout)["current"]
    assert promoted["run_id"] == "sw-00" and promoted["sweep"] == {"ranked_by": "final_eval_loss", "members": 2}
    # One promotion record shape, whoever promotes: a sweep's names the sources, the adapter and the versions too.
    assert promoted["sources"]["peft"] == reports["sw-00"]["export"]["peft_url"]
    assert promoted["adapter"]["r"] == 32 and promoted["versions"]["skyrl_tx"] == "0.3.0"
    assert promoted["approver"] is None
    assert_tracked_in_mlflow(work, reports)
    assert "| 1 | sw-00 | 0.02 | 32 | passed |" in (work / "sweep" / "ranking.md").read_text()
    # The member trained and sampled exactly as the same run alone on the cluster does: its neighbour's requests,
    # pending beside its own, were never in its batches (`one-adapter-batches`) and never put its optimizer step
    # before its gradient (`requests-in-order`).
    alone = start_run(shared, "sw-alone", "--learning-rate", "2e-2", "--steps", "4")
    out, _ = alone.communicate(timeout=300)
    assert alone.returncode == 0, (work / "sw-alone.log").read_text()[-3000:]
    solo = json.loads(out)
    assert [m["nll"] for m in solo["metrics"]] == [m["nll"] for m in reports["sw-00"]["metrics"]]
    for figure in ("loss_before", "loss_after", "final_eval_loss", "live_tokens", "restored_tokens"):
        assert solo["restore"][figure] == reports["sw-00"]["restore"][figure], figure
    found = wait_for(lambda: (s := status(shared))["free_slots"] == ADAPTERS - 1 and s, 60, "slots released")
    assert found["healthy"] and found["attached_runs"] == []
    assert json.loads((shared["dir"] / "run-keys.json").read_text()) == {}


def assert_tracked_in_mlflow(work: Path, reports: dict[str, dict]) -> None:
    """The sweep is one MLflow run with its members as children; each member has its options as parameters
    (no credential), its per-step metrics, its evaluations, its report and curve, and its adapter's path."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{work / '.txflow' / 'mlflow.db'}")
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("txflow").experiment_id])}
    assert set(runs) == {"sweep sw", "sw-00", "sw-01"}, sorted(runs)
    parent = runs["sweep sw"]
    assert parent.data.tags["txflow.best"] == "sw-00" and parent.info.status == "FINISHED"
    assert json.loads(parent.data.params["learning_rates"]) == [0.02, 50.0]
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"ranking.json"}
    for name, report in reports.items():
        run = runs[name]
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert run.info.status == ("FINISHED" if report["status"] == "passed" else "FAILED")
        params = run.data.params
        assert params["mode"] == "sft" and float(params["learning_rate"]) == report["learning_rate"]
        assert params["lora_rank"] == "32" and params["mesh.tp"] == "1" and "api_key" not in params
        assert not any(marker in value for value in params.values() for marker in ("tml-", "sk-"))
        history = client.get_metric_history(run.info.run_id, "nll")
        assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == \
            [(m["step"], m["nll"]) for m in report["metrics"]]
        assert run.data.metrics["eval/final_eval_loss"] == report["restore"]["final_eval_loss"]
        assert {"report.json", "curve.png"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    good = runs["sw-00"]
    assert good.data.tags["txflow.adapter"] == reports["sw-00"]["export"]["peft_url"]
    assert good.data.metrics["export/max_abs_logprob_diff"] == reports["sw-00"]["export"]["max_abs_logprob_diff"]


def test_an_rl_sweeps_members_evaluate_the_base_model_once(shared):
    """RL's restore check samples the base model at fixed seeds (`group_size` samples of every held-out prompt)
    besides its greedy answers: a sweep computes each once, whichever member needs it first, and the members'
    figures are that one computation's."""
    work = shared["work"]
    result = run_txflow(["sweep", "rl", "--base-model", "tiny", "--cluster", NAME, "--learning-rate", "2e-2,5e-2",
                         "--steps", "2", "--save-every", "0", "--sweep-id", "rlsw", "--checkpoints",
                         str(work / "ckpt"), "--state-dir", str(work / "rlsweep"), "--no-export", "--json"],
                        shared["env"], work)
    assert result.returncode in (0, 1), result.stderr[-3000:]  # two steps of the tiny model may not pass RL's bar
    restores = [json.loads((work / "ckpt" / f"rlsw-0{i}" / "report.json").read_text())["restore"] for i in range(2)]
    for kind in ("greedy_tokens", "eval_rewards"):
        assert sum(kind in r.get("shared_base_figures", []) for r in restores) == 1, restores
    assert restores[0]["base_eval_reward"] == restores[1]["base_eval_reward"]
    assert [a["base"] for a in restores[0]["answers"]] == [a["base"] for a in restores[1]["answers"]]
    assert all(r["abs_diff"] <= 1e-6 and r["sampler_tokens_match"] for r in restores)


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
        began = time.monotonic()
        interrupted(proc, work / "cut.log")
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (work / "cut.log").read_text()
    assert "sweep interrupted: stopping its 2 runs" in log, log[-3000:]
    print(f"sweep exited {took:.1f} s after SIGTERM")
    steps = [len(m.read_text().splitlines()) for m in metrics]
    assert all(n < 400 for n in steps), steps  # stopped, not run to the end
    assert json.loads((shared["dir"] / "run-keys.json").read_text()) == {}
    assert status(shared)["healthy"]
    # Each member tore down as a cancelled run does: its models unloaded by its own release (the engine would
    # free them only minutes after their sessions' last heartbeat).
    wait_for(lambda: status(shared)["free_slots"] == ADAPTERS - 1, 15, "the members' slots freed")
    assert log.count("the run's key revoked; the cluster stays up") == 2, log[-3000:]


SFT_CLIENT = Path(__file__).parent / "clients" / "sft_client.py"


def test_two_custom_runs_and_a_notebook_key_train_side_by_side_each_reaching_only_its_own(shared):
    """`txflow run custom --cluster` twice at once, each client training and saving with its run's key, each run
    committing and verifying only its own client's checkpoints; beside them a notebook's process with a key
    from `txflow cluster key`: it trains, is listed, reaches nothing of the runs', and once revoked gets 401.
    A second run with an attached run id is refused while the first holds it."""
    import sys

    work, env = shared["work"], shared["env"]
    issued = run_txflow(["cluster", "key", NAME, "--label", "nb", "--ttl", "1h"], env, work, timeout=60)
    assert issued.returncode == 0, issued.stderr
    exported = dict(line.removeprefix("export ").split("=", 1) for line in issued.stdout.splitlines())
    assert set(exported) == {"TINKER_BASE_URL", "TINKER_API_KEY"} and exported["TINKER_API_KEY"].startswith("tml-")
    again = run_txflow(["cluster", "key", NAME, "--label", "nb"], env, work, timeout=60)
    assert again.returncode == 2 and "has a key labelled nb already" in again.stderr

    def custom(run_id: str, hold_at: str = "") -> subprocess.Popen:
        holds = work / f"{run_id}-holds"
        holds.mkdir(exist_ok=True)
        run_env = env | {"TXFLOW_HOLD_AT": hold_at, "TXFLOW_HOLD_DIR": str(holds)}
        with open(work / f"{run_id}.log", "w") as log:
            return subprocess.Popen(txflow_cmd(
                "run", "custom", "--base-model", "tiny", "--cluster", NAME, "--run-id", run_id, "--client",
                str(SFT_CLIENT), "--client-arg=--base-url", "--client-arg={base_url}", "--client-arg=--model-name",
                "--client-arg={base_model}", "--checkpoints", str(work / "ckpt"), "--state-dir", str(work / run_id),
                "--no-export", "--json"), env=run_env, cwd=work, stdout=subprocess.PIPE, stderr=log, text=True)

    runs = {"custom-a": custom("custom-a", hold_at="evaluate-restore"), "custom-b": custom("custom-b")}
    try:
        # The notebook's process: any Tinker client, the exported variables its only configuration.
        model_path = json.loads((shared["dir"] / "serves.json").read_text())["base_model_path"]
        notebook = subprocess.run([sys.executable, str(SFT_CLIENT), "--base-url", exported["TINKER_BASE_URL"],
                                   "--model-name", model_path, "--steps", "2"], env=env | exported,
                                  capture_output=True, text=True, timeout=600)
        assert notebook.returncode == 0, notebook.stderr[-3000:]
        notebook_model = notebook.stdout.split("saved state tinker://")[1].split("/")[0]
        # Held while attached (its client done, its checkpoints committed): the same run id elsewhere (another
        # checkpoints root, so no lease stops it first) is refused at attach.
        wait_for(lambda: (work / "custom-a-holds" / "evaluate-restore.held").exists(), 600, "custom-a held")
        twin = run_txflow(["run", "custom", "--base-model", "tiny", "--cluster", NAME, "--run-id", "custom-a",
                           "--client", str(SFT_CLIENT), "--checkpoints", str(work / "ckpt-twin"), "--state-dir",
                           str(work / "custom-a-twin"), "--no-export"], env, work, timeout=300)
        (work / "custom-a-holds" / "evaluate-restore.release").touch()
        reports = {}
        for run_id, run in runs.items():
            out, _ = run.communicate(timeout=900)
            assert run.returncode == 0, (work / f"{run_id}.log").read_text()[-4000:]
            reports[run_id] = json.loads(out)
    finally:
        stop_if_running(*runs.values())
    assert twin.returncode != 0 and "run id custom-a is attached to cluster shared already" in twin.stderr
    models = {}
    for run_id, report in reports.items():
        assert report["status"] == "passed" and report["restore"]["passed"]
        committed = {c["tinker_path"] for c in report["checkpoints"]["all"]}
        client = (work / run_id / "logs" / "client.log").read_text()
        saved = {line.split("saved ")[1].split()[-1] for line in client.splitlines() if "saved " in line}
        assert committed == saved  # its client's two checkpoints, nothing of the other run's or the notebook's
        models[run_id] = {p.removeprefix("tinker://").split("/")[0] for p in committed}
    assert len(models["custom-a"] | models["custom-b"] | {notebook_model}) == 3
    listed = run_txflow(["cluster", "keys", NAME, "--json"], env, work, timeout=60)
    rows = json.loads(listed.stdout)
    assert [(r["label"], r["kind"], r["expired"]) for r in rows] == [("nb", "key", False)]  # both runs released
    base, key = exported["TINKER_BASE_URL"], exported["TINKER_API_KEY"]
    [run_model] = models["custom-a"]
    assert httpx.post(f"{base}/api/v1/get_info", json={"model_id": run_model, "type": "get_info"},
                      headers={"X-API-Key": key}, timeout=30).status_code in (401, 403)
    own = httpx.post(f"{base}/api/v1/get_info", json={"model_id": notebook_model, "type": "get_info"},
                     headers={"X-API-Key": key}, timeout=30)
    assert own.status_code == 200
    revoked = run_txflow(["cluster", "keys", NAME, "--revoke", "nb"], env, work, timeout=60)
    assert revoked.returncode == 0 and "revoked" in revoked.stderr
    after = httpx.post(f"{base}/api/v1/get_info", json={"model_id": notebook_model, "type": "get_info"},
                       headers={"X-API-Key": key}, timeout=30)
    assert after.status_code == 401
    assert json.loads(run_txflow(["cluster", "keys", NAME, "--json"], env, work, timeout=60).stdout) == []


def test_txflow_serve_answers_the_openai_client_with_what_the_runs_sampler_computes(shared):
    """A run trains on the cluster; `txflow serve` serves its checked sampler as `mine` beside the base model.
    Through the official `openai` client, the logprobs of the run's reference sequences (a prompt scored with
    `echo`, as evaluation harnesses ask) are the sampler's as evaluate-restore recorded them, and the base model's
    are not; the greedy completion of each reference prompt is the sampler's greedy tokens up to the end of
    sequence; a wrong key gets 401; SIGTERM unloads the adapter and gives the key back, and the cluster stays
    up with as many slots free as before."""
    import openai

    from txflow.checkpoints import export
    from txflow.training.tokenizer import load_tokenizer

    work, env = shared["work"], shared["env"]
    run = start_run(shared, "to-serve", "--steps", "3")
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, (work / "to-serve.log").read_text()[-3000:]
    root = json.loads(out)["checkpoint_root"]
    reference = export.read_reference(root, {})
    before = status(shared)  # what earlier tests' clients may still hold (a notebook's until its session ends)
    with open(work / "serve.log", "w") as log:
        server = subprocess.Popen(txflow_cmd("serve", "--cluster", NAME, "--adapter", f"mine={root}", "--port", "0"),
                                  env=env, cwd=work, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        exported = dict(server.stdout.readline().strip().removeprefix("export ").split("=", 1) for _ in range(2))
        assert set(exported) == {"OPENAI_BASE_URL", "OPENAI_API_KEY"}, (work / "serve.log").read_text()[-3000:]
        assert exported["OPENAI_BASE_URL"].startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=exported["OPENAI_BASE_URL"], api_key=exported["OPENAI_API_KEY"],
                               max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny", "mine"]
        tokenizer = load_tokenizer(reference.base_model)
        eos = tokenizer.eos_token_id
        for sequence, logprobs in zip(reference.sequences, reference.logprobs):
            scored = {model: client.completions.create(model=model, prompt=sequence, echo=True, logprobs=0,
                                                       max_tokens=0, temperature=0).choices[0].logprobs
                      for model in ("mine", "tiny")}
            assert scored["mine"].token_logprobs[0] is None and len(scored["mine"].tokens) == len(sequence)
            assert max(abs(a - b) for a, b in zip(scored["mine"].token_logprobs[1:], logprobs)) <= 1e-4
            assert max(abs(a - b) for a, b in zip(scored["tiny"].token_logprobs[1:], logprobs)) > 1e-2
        # The trained tiny model mostly ends at once (its end-of-sequence token is 0): the comparison above is
        # the one that sees every token.
        for prompt, greedy in zip(reference.prompts, reference.greedy_tokens):
            want = greedy[:greedy.index(eos)] if eos in greedy else greedy
            done = client.completions.create(model="mine", prompt=prompt, max_tokens=len(greedy), temperature=0,
                                             logprobs=0)
            [choice] = done.choices
            assert choice.text == tokenizer.decode(want) and done.usage.completion_tokens == len(want)
            assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in want]
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="sk-someone-else").completions.create(model="mine", prompt="a")
        assert "to-serve" not in status(shared)["attached_runs"]
        assert any(r.startswith("serve-") for r in status(shared)["attached_runs"])
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, (work / "serve.log").read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)
    assert exported["OPENAI_API_KEY"] not in (work / "serve.log").read_text()
    found = wait_for(lambda: (s := status(shared))["free_slots"] >= before["free_slots"] and s, 60,
                     "the adapter unloaded")
    assert found["healthy"] and found["attached_runs"] == before["attached_runs"]


def test_cluster_up_detach_returns_once_the_cluster_is_up_and_down_leaves_nothing(shared):
    """`txflow cluster up --detach` hands the terminal back once the cluster serves (its holder in a session of
    its own, out of reach of the terminal's Ctrl-C); `cluster down` stops it all."""
    from txflow.cluster import named

    work, env = shared["work"], shared["env"]
    up = run_txflow(["cluster", "up", "detached", "--base-model", "tiny", "--processes", "1", "--lora-adapters", "8",
                     "--detach"], env, work, timeout=400)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        assert "cluster detached up on http://127.0.0.1:" in up.stderr
        serves = named.load_serves("detached")
        assert serves.state == "up" and named.healthy(serves)
        assert os.getsid(serves.holder_pid) == serves.holder_pid  # a session of its own
        again = run_txflow(["cluster", "up", "detached", "--base-model", "tiny", "--detach"], env, work, timeout=60)
        assert again.returncode == 2 and "is up already" in again.stderr
    finally:
        run_txflow(["cluster", "down", "detached"], env, work, timeout=60)
    wait_for(lambda: alive_pids(shared["dir"].parent / "detached") == [], 30, "the detached cluster gone")
    assert not named.healthy(named.load_serves("detached"))


def test_a_killed_cluster_is_named_and_each_run_retries_where_it_was_told(shared, reaper):
    """The cluster is killed under two attached runs. Each names it within seconds. The one told to fall back
    to a cluster of its own (`--cluster-fallback own`) resumes from its last committed state on a fresh cluster
    of its own while the shared one stays dead, passes, and stops that cluster; the other (the default, `wait`)
    resumes on the shared cluster once it is started again, and passes."""
    from txflow.cluster import named

    work, env = shared["work"], shared["env"]
    # Both held after step 7 (its state of step 5 committed) while the cluster is killed, then let go.
    runs = {"survivor": start_run(shared, "survivor", "--steps", "16", "--startup-timeout", "600",
                                  hold_at="train-step-7"),
            "on-its-own": start_run(shared, "on-its-own", "--steps", "16", "--cluster-fallback", "own",
                                    "--processes", "1", "--startup-timeout", "120", hold_at="train-step-7")}
    waits, own = runs["survivor"], runs["on-its-own"]
    reaper.watch(work / "on-its-own")  # the cluster of its own, should the run leave it behind
    try:
        for run_id, run in runs.items():
            held = work / f"{run_id}-holds" / "train-step-7.held"
            wait_for(lambda held=held, run=run: held.exists() or run.poll() is not None, 300, f"{run_id} at step 7")
            assert run.poll() is None, (work / f"{run_id}.log").read_text()[-3000:]
        holder = shared["holders"][-1]
        holder.send_signal(signal.SIGKILL)  # the cluster's processes die with their holder
        killed_at = time.time()
        for run_id in runs:
            (work / f"{run_id}-holds" / "train-step-7.release").touch()
        holder.wait(timeout=30)
        # Its retry starts its own cluster at once: it does not sit on what it had in flight on the dead one.
        wait_for(lambda: (work / "on-its-own" / "cluster.json").exists(), 30, "a cluster of its own started")
        own_out, _ = own.communicate(timeout=600)
        assert not status(shared)["healthy"]  # it passed with the shared cluster dead throughout
        shared["holders"].append(start_cluster(env, work, work / "up-again.log"))
        waits_out, _ = waits.communicate(timeout=600)
    finally:
        stop_if_running(waits, own)
    for run, out, run_id in ((own, own_out, "on-its-own"), (waits, waits_out, "survivor")):
        assert run.returncode == 0, (work / f"{run_id}.log").read_text()[-3000:]
        report = json.loads(out)
        assert report["status"] == "passed"
        [failure] = report["failures"]
        assert f"cluster {NAME}" in failure["message"]
        assert failure["detected_at"] - killed_at < 5
        assert report["resumed_from_step"] == failure["resumed_from_step"] == 5
        if run is own:  # its own cluster, stopped by its teardown; the dead shared one released once
            assert {r["role"] for r in report["cluster"]["ranks"]} >= {"api", "coordinator"}
            assert alive_pids(work / "on-its-own") == []
            # Its models live in a database of its own: the shared cluster's is no place for a second engine.
            model = report["checkpoints"]["state"]["tinker_path"].removeprefix("tinker://").split("/")[0]
            assert model in named.loaded_models(f"sqlite:///{work / 'on-its-own' / 'tinker.db'}", unloading=None)
            assert (work / "on-its-own.log").read_text().count("released from cluster") == 1
        else:
            assert report["cluster"]["ranks"] == []
