"""The Prefect deployments of prefect.yaml end to end: a real `prefect server`
(loopback, its own PREFECT_HOME), `prefect deploy --all` from the repository
root, a `process` worker, and real `train` runs through it: one that completes
and publishes its artifacts, one cancelled and one crashed mid-training whose
clusters must be stopped by the flow's on_cancellation / on_crashed hooks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from deployments.defaults import NIGHTLY_SFT
from tests.helpers import PREFECT, alive_pids, cluster_pids, descendants, new_prefect_home
from txflow.config import RunConfig
from txflow.processes.ports import free_port
from txflow.processes.procfs import is_alive

pytestmark = [pytest.mark.e2e, pytest.mark.together, pytest.mark.heavy(1)]

REPO = Path(__file__).resolve().parents[1]
RUN_DEADLINE_S = 600
DEPLOYMENTS = {"train/sft", "train/rl", "nightly-validation/nightly", "sweep/lr"}
UUID_RE = re.compile(r"UUID: ([0-9a-f-]{36})")


# --------------------------------------------------------------------------- processes


def _start(cmd: list[str], log: Path, env: dict, cwd: Path = REPO) -> subprocess.Popen:
    """A subprocess in its own process group (session), output to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, start_new_session=True)


def _stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the process group, SIGKILL it after `grace_s`; then SIGKILL any descendant left
    (flow run processes and their children live in sessions of their own)."""
    left = descendants(proc.pid)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    for pid, started in left:
        if started is not None and is_alive(pid, started):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


# --------------------------------------------------------------------------- server, deploy, worker


@dataclass
class Server:
    port: int
    home: Path
    logs: Path
    env: dict[str, str]  # environment of CLI / worker subprocesses

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def prefect(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run([PREFECT, *args], env=self.env, cwd=REPO, capture_output=True, text=True,
                                timeout=timeout)
        assert result.returncode == 0, f"prefect {' '.join(args)}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        return result


def _base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        TINKER_TELEMETRY="0",
        PYTHONUNBUFFERED="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory, prefect_db):
    """`prefect server start` on a free loopback port with a temporary PREFECT_HOME."""
    work = tmp_path_factory.mktemp("prefect")
    home, logs = new_prefect_home(work / "home", prefect_db), work / "logs"
    logs.mkdir()
    port = free_port()
    server_env = _base_env(home)
    # Schedules are stored, but no scheduled run is created: a test run at 03:00 UTC
    # must not pick up a nightly run.
    server_env["PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED"] = "false"
    proc = _start([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], logs / "server.log",
                  server_env)
    try:
        began, healthy = time.monotonic(), False
        while time.monotonic() - began < 180 and proc.poll() is None:
            try:
                healthy = httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2, trust_env=False).json() is True
            except (httpx.HTTPError, ValueError):
                pass
            if healthy:
                break
            time.sleep(0.5)
        assert healthy, f"prefect server not healthy (exit {proc.poll()}):\n{_tail(logs / 'server.log')}"
        print(f"prefect server healthy on port {port} after {time.monotonic() - began:.1f} s")
        env = _base_env(home)
        env.update(PREFECT_API_URL=f"http://127.0.0.1:{port}/api", PREFECT_WORKER_QUERY_SECONDS="2")
        yield Server(port=port, home=home, logs=logs, env=env)
    finally:
        _stop(proc)


@contextmanager
def api(server: Server):
    """A synchronous Prefect client of the test server."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        with get_client(sync_client=True) as client:
            yield client


@pytest.fixture(scope="module")
def deployed(server):
    """The work pool and every deployment of prefect.yaml, as docs/deployments-and-nightly.md says."""
    server.prefect("work-pool", "create", "txflow", "--type", "process")
    # `{{ $PWD }}` is the environment variable, as a shell in the repository root sets it.
    env = dict(server.env, PWD=str(REPO))
    began = time.monotonic()
    result = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all"], env=env, cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"prefect deploy failed:\n{result.stdout[-6000:]}\n{result.stderr[-4000:]}"
    print(f"prefect deploy --all: {time.monotonic() - began:.1f} s")
    return result.stdout


@dataclass
class Worker:
    pid: int
    log: Path

    def tail(self) -> str:
        return _tail(self.log)


@pytest.fixture(scope="module")
def worker(server, deployed):
    """`prefect worker start --pool txflow` from the repository root."""
    log = server.logs / "worker.log"
    proc = _start([PREFECT, "worker", "start", "--pool", "txflow"], log, server.env)
    try:
        deadline = time.monotonic() + 120
        with api(server) as client:
            while not client.read_workers_for_work_pool("txflow"):
                assert proc.poll() is None, f"worker exited {proc.returncode}:\n{_tail(log)}"
                assert time.monotonic() < deadline, f"worker did not register:\n{_tail(log)}"
                time.sleep(1)
        yield Worker(pid=proc.pid, log=log)
    finally:
        _stop(proc)


@pytest.fixture
def started_runs(server, reaper):
    """Flow run ids a test started. One still running when the test ends (it failed) is
    cancelled, so the worker stops its process; then `reaper` stops what is left of its cluster."""
    ids: list[str] = []
    yield ids
    for flow_run_id in ids:
        with api(server) as client:
            run = client.read_flow_run(uuid.UUID(flow_run_id))
            if run.state is None or run.state.is_final():
                continue
            subprocess.run([PREFECT, "flow-run", "cancel", flow_run_id], env=server.env, cwd=REPO,
                           capture_output=True, timeout=120)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not client.read_flow_run(run.id).state.is_final():
                time.sleep(2)


def _run_deployment(server: Server, name: str, params: dict, started_runs: list[str]) -> str:
    """`prefect deployment run NAME --params JSON`; returns the flow run id."""
    out = server.prefect("deployment", "run", name, "--params", json.dumps(params)).stdout
    match = UUID_RE.search(out)
    assert match, out
    started_runs.append(match.group(1))
    return match.group(1)


def _wait_final(server: Server, flow_run_id: str, worker: Worker, deadline_s: float = RUN_DEADLINE_S):
    deadline = time.monotonic() + deadline_s
    with api(server) as client:
        while True:
            run = client.read_flow_run(uuid.UUID(flow_run_id))
            if run.state is not None and run.state.is_final():
                return run
            assert time.monotonic() < deadline, (
                f"flow run {flow_run_id} still {run.state and run.state.name} after {deadline_s} s:\n{worker.tail()}")
            time.sleep(2)


def _wait_training_started(state: Path, flow_run_id: str, server: Server, worker: Worker) -> None:
    """Until `<state>/metrics.jsonl` has a line: the cluster runs and trains."""
    deadline = time.monotonic() + RUN_DEADLINE_S
    metrics = state / "metrics.jsonl"
    with api(server) as client:
        while not (metrics.exists() and metrics.read_text().strip()):
            run = client.read_flow_run(uuid.UUID(flow_run_id))
            assert not (run.state and run.state.is_final()), f"run ended as {run.state.name}:\n{worker.tail()}"
            assert time.monotonic() < deadline, f"no training step after {RUN_DEADLINE_S} s:\n{worker.tail()}"
            time.sleep(1)


def _config(tmp_path: Path, run_id: str, steps: int) -> dict:
    return {"mode": "sft", "base_model": "tiny", "steps": steps, "save_every": 0, "processes": 2, "run_id": run_id,
            "checkpoints": str(tmp_path / "ckpt"), "state_dir": str(tmp_path / "state")}


def _flow_run_logs(server: Server, flow_run_id: str) -> list[str]:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with api(server) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(flow_run_id)])))
    return [f"{log.timestamp} {log.message}" for log in logs]


# --------------------------------------------------------------------------- against the server


def test_deployments_on_the_server(server, deployed):
    from deployments.defaults import CONFIGS, SWEEP_GRID

    with api(server) as client:
        deployments = {name: client.read_deployment_by_name(name) for name in DEPLOYMENTS}
    for name, deployment in deployments.items():
        assert deployment.work_pool_name == "txflow", name
        # The pull step runs this checkout: `{{ $PWD }}` was filled in at deploy time.
        assert deployment.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}], name
        assert deployment.enforce_parameter_schema, name
        assert deployment.job_variables.get("env", {}).get("TINKER_TELEMETRY") == "0", name
    assert deployments["train/sft"].parameters == {"config": CONFIGS["sft"]}
    assert deployments["train/rl"].parameters == {"config": CONFIGS["rl"]}
    assert deployments["nightly-validation/nightly"].parameters == {"sft": CONFIGS["nightly_sft"],
                                                                    "rl": CONFIGS["nightly_rl"]}
    assert deployments["sweep/lr"].parameters == {"config": CONFIGS["sweep"], **SWEEP_GRID}
    # The UI form: RunConfig's fields, typed, with the model's descriptions.
    for name, params, extra in (("train/sft", ["config"], set()),
                                ("nightly-validation/nightly", ["sft", "rl"], {"modes", "history_root"})):
        schema = deployments[name].parameter_openapi_schema
        assert set(schema["properties"]) == set(params) | extra, name
        assert all(schema["properties"][p]["$ref"] == "#/definitions/RunConfig" for p in params)
        fields = schema["definitions"]["RunConfig"]["properties"]
        assert set(fields) == set(RunConfig.model_fields)
        for field, info in RunConfig.model_fields.items():
            # An option group's description is its class's docstring: the schema keeps it on the definition.
            ref = fields[field].get("$ref", "").rsplit("/", 1)[-1]
            shown = fields[field].get("description") or schema["definitions"].get(ref, {}).get("description")
            assert info.description and shown == info.description, field
        assert fields["mode"]["enum"] == ["sft", "rl", "custom"]
        assert fields["steps"]["type"] == "integer"
        assert schema["definitions"]["MeshConfig"]["properties"]["tp"]["description"]
    assert [s.schedule.cron for s in deployments["train/sft"].schedules + deployments["train/rl"].schedules] == []


def test_a_deployment_takes_its_database_url_from_a_prefect_secret_block(server, deployed):
    """docs/deployments-and-nightly.md, "Credentials": job variables name the block,
    `{{ prefect.blocks.secret.NAME }}`; the worker resolves it into the flow run process's environment when it
    starts the run (Prefect stores and shows the reference only), and the flow reads TXFLOW_DATABASE_URL there."""
    import asyncio

    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.workers.process import ProcessJobConfiguration

    secret = "postgresql://txflow:block-MARKER-1d9e@/tinker?host=/run/pg"
    reference = {"env": {"TXFLOW_DATABASE_URL": "{{ prefect.blocks.secret.txflow-database-url }}"}}

    async def job_environment() -> dict:
        async with get_client() as client:
            pool = await client.read_work_pool("txflow")
            job = await ProcessJobConfiguration.from_template_and_values(pool.base_job_template, reference,
                                                                           client=client)
        return job.env

    with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        Secret(value=secret).save("txflow-database-url", overwrite=True)
        env = asyncio.run(job_environment())
    assert env["TXFLOW_DATABASE_URL"] == secret
    os.environ["TXFLOW_DATABASE_URL"] = env["TXFLOW_DATABASE_URL"]  # the flow run process's environment
    try:
        assert RunConfig().resolved().database_url.get_secret_value() == secret
    finally:
        del os.environ["TXFLOW_DATABASE_URL"]


def test_unknown_config_field_is_rejected_before_any_run(server, deployed):
    """enforce_parameter_schema: the server checks overrides against RunConfig's schema."""
    params = {"config": {"mode": "sft", "stepz": 3}}
    result = subprocess.run([PREFECT, "deployment", "run", "train/sft", "--params", json.dumps(params)],
                            env=server.env, cwd=REPO, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "stepz" in output, output
    assert not UUID_RE.search(output)


def test_nightly_deployment_has_its_cron_schedule(server, deployed):
    with api(server) as client:
        deployment = client.read_deployment_by_name("nightly-validation/nightly")
    assert len(deployment.schedules) == 1
    schedule = deployment.schedules[0]
    assert schedule.active
    assert schedule.schedule.cron == "0 3 * * *"
    assert schedule.schedule.timezone == "UTC"


def _task_times(server: Server, flow_run_id: str) -> dict[str, tuple[float, float]]:
    """{task name without its suffix: (start, end)} of the flow run's task runs (epoch seconds)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with api(server) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(flow_run_id)])))
    return {t.name.rsplit("-", 1)[0]: (t.start_time.timestamp(), t.end_time.timestamp())
            for t in runs if t.start_time and t.end_time}


def test_three_sft_deployment_runs_take_turns_on_the_slots_and_wait_for_approval_without_a_cluster(
        server, worker, tmp_path, reaper, started_runs):
    """With the global concurrency limit at 1 slot, three 1-process runs never hold a cluster at the same
    time (a run occupies one slot per JAX process; two ranks would only make each turn slower). Each asks
    for approval to be promoted as `prod`, with its cluster torn down first: one is approved (through
    Prefect's client API, as the UI does) and promoted, one rejected, one never answered (it ends completed,
    not promoted). Each publishes its report and metrics as artifacts."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.flow_runs import resume_flow_run
    from prefect.settings import PREFECT_API_URL, temporary_settings

    limit = RunConfig.model_fields["concurrency_limit"].default
    server.prefect("gcl", "create", limit, "--limit", "1")
    checkpoints = tmp_path / "ckpt"
    # The approved run's answer names its approver in the form; the rejected run's answer is written with a
    # sender before the resume (as a client that knows its user can), which Prefect stores with it.
    answers = {"approved": {"approve": True, "comment": "ship it", "approver": "alice"},
               "rejected": {"approve": False, "comment": "not this one"}, "unanswered": None}
    senders = {"rejected": "bob@example.org"}
    approvers = {"approved": "alice (named in the approval form; the Prefect server records no user)",
                 "rejected": "bob@example.org (the sender Prefect stored with the answer)", "unanswered": None}
    try:
        runs = {}
        for name in answers:
            run_id = f"dep-sft-{name}-{uuid.uuid4().hex[:6]}"
            state = reaper.watch(tmp_path / name / "state")
            config = {**_config(tmp_path / name, run_id, steps=6), "processes": 1, "state_dir": str(state),
                      "checkpoints": str(checkpoints),
                      "export": {"promote_as": "prod", "approve": True,
                                 "approve_timeout_s": 20 if answers[name] is None else 600}}
            runs[name] = (run_id, _run_deployment(server, "train/sft", {"config": config}, started_runs), state)
        began = time.monotonic()
        asked: dict[str, str] = {}
        deadline = time.monotonic() + 1200
        with api(server) as client:
            while not all(client.read_flow_run(uuid.UUID(f)).state.is_final() for _, f, _ in runs.values()):
                assert time.monotonic() < deadline, worker.tail()
                for name, (_run_id, flow_run_id, state) in runs.items():
                    run = client.read_flow_run(uuid.UUID(flow_run_id))
                    if name in asked or not run.state.is_paused():
                        continue
                    # Paused for a person: the cluster is gone, and the UI shows the run's figures.
                    assert alive_pids(state) == [], name
                    keyset = run.state.state_details.run_input_keyset
                    try:
                        asked[name] = client.read_flow_run_input(flow_run_id=run.id, key=keyset["description"])
                    except httpx.HTTPStatusError as exc:
                        if exc.response.status_code != 404:
                            raise
                        # Prefect sets Paused first and writes the input's schema and description after
                        # (flow_runs.pause_flow_run): ask again on the next round, as the UI would.
                        continue
                    if name in senders:
                        client.create_flow_run_input(run.id, keyset["response"], json.dumps(answers[name]),
                                                     sender=senders[name])
                    if answers[name] is not None:
                        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
                            resume_flow_run(run.id, run_input=None if name in senders else answers[name])
                time.sleep(1)
        finished = {name: _wait_final(server, flow_run_id, worker) for name, (_, flow_run_id, _) in runs.items()}
        print(f"three train/sft runs with approvals: {time.monotonic() - began:.1f} s")
    finally:
        server.prefect("--no-prompt", "gcl", "delete", limit)
    for name, run in finished.items():
        assert run.state.is_completed(), f"{name}: {run.state.name}: {run.state.message}\n{worker.tail()}"
    # One cluster at a time: whichever got the slots first tore down before the next provisioned.
    spans = sorted((times["provision-coordinator"][0], times["teardown"][1])
                   for times in (_task_times(server, flow_run_id) for _, flow_run_id, _ in runs.values()))
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), spans

    for name, (run_id, _flow_run_id, state) in runs.items():
        assert f"Promote run `{run_id}` (sft, 6 steps" in asked[name] and "eval_loss_gain" in asked[name]
        run = finished[name]
        assert run.parameters["config"]["run_id"] == run_id
        with api(server) as client:
            artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        by_type: dict[str, list] = {}
        for artifact in artifacts:
            by_type.setdefault(artifact.type, []).append(artifact)
        key = run_id.lower()
        reports = [a for a in by_type.get("markdown", []) if (a.key or "").startswith("report-")]
        assert [a.key for a in reports] == [f"report-{key}"]
        assert f"txflow run `{run_id}`: passed" in reports[0].data and "## Promotion" in reports[0].data
        # The metrics table while the run trained (a version after each step), then the whole run's with the
        # report: the UI shows the latest.
        tables = sorted(by_type.get("table", []), key=lambda a: a.created)
        assert {a.key for a in tables} == {f"metrics-{key}"}
        versions = [[row["step"] for row in (json.loads(a.data) if isinstance(a.data, str) else a.data)]
                    for a in tables]
        assert versions == [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]], versions
        progress = by_type.get("progress", [])
        assert [a.key for a in progress] == [f"progress-{key}"]
        assert float(progress[0].data) == 100.0
        report = json.loads((checkpoints / run_id / "report.json").read_text())
        assert report["status"] == "passed" and len(report["metrics"]) == 6
        promotion = report["promotion"]
        assert promotion["status"] == {"approved": "promoted", "rejected": "rejected",
                                       "unanswered": "not approved in time"}[name], promotion
        assert promotion["comment"] == (answers[name] or {}).get("comment"), promotion
        assert promotion["approver"] == approvers[name], promotion
        if approvers[name]:
            assert f"by: {approvers[name]}" in reports[0].data
        assert alive_pids(state) == []
    current = json.loads((checkpoints / "promoted" / "prod" / "current.json").read_text())
    assert current["run_id"] == runs["approved"][0]
    record = json.loads((checkpoints / "promoted" / "prod" / current["path"] / "promotion.json").read_text())
    assert record["approval_comment"] == "ship it" and record["approver"] == approvers["approved"]
    assert [p.name for p in (checkpoints / "promoted" / "prod" / "history").iterdir()] == [current["id"]]


def test_cancelled_deployment_run_stops_its_cluster(server, worker, tmp_path, reaper, started_runs):
    state = reaper.watch(tmp_path / "state")
    run_id = f"dep-cancel-{uuid.uuid4().hex[:8]}"
    # One rank: what is under test is Prefect's cancel path; stopping a second rank is the same code
    # (tests/test_cluster_e2e.py stops two after an exception, SIGTERM and SIGKILL).
    params = {"config": {**_config(tmp_path, run_id, steps=500), "processes": 1}}
    flow_run_id = _run_deployment(server, "train/sft", params, started_runs)
    _wait_training_started(state, flow_run_id, server, worker)
    pids = [pid for pid, _ in cluster_pids(state)]
    assert len(pids) == 2 and alive_pids(state) == pids  # api, rank 0

    cancelled_at = time.monotonic()
    server.prefect("flow-run", "cancel", flow_run_id)
    run = _wait_final(server, flow_run_id, worker, deadline_s=300)
    print(f"cancel -> {run.state.name} in {time.monotonic() - cancelled_at:.1f} s")
    assert run.state.is_cancelled(), f"{run.state.name}: {run.state.message}\n{worker.tail()}"
    assert alive_pids(state) == [], "\n".join(_flow_run_logs(server, flow_run_id)[-20:])
    # The flow's own `finally` stops the cluster (SIGTERM arrives as an exception); the worker then
    # runs on_cancellation in a process of its own, which must say in the run's logs what it did.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        hook_lines = [line for line in _flow_run_logs(server, flow_run_id) if "hook: stopped the cluster in" in line]
        if hook_lines:
            break
        time.sleep(1)
    assert hook_lines, "on_cancellation hook did not run:\n" + worker.tail()
    assert str(state) in hook_lines[0] and all(f"pid {pid} " in hook_lines[0] for pid in pids), hook_lines


def _engine_pid(worker_pid: int, flow_run_id: str) -> int:
    """The flow run process the worker started (`python -m prefect.engine`) for `flow_run_id`."""
    for pid, _ in descendants(worker_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"prefect.engine" in cmdline and f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in environ:
            return pid
    raise AssertionError(f"no flow run process for {flow_run_id} under worker {worker_pid}")


def test_crashed_deployment_run_stops_its_cluster(server, worker, tmp_path, reaper, started_runs):
    """SIGKILL of the flow run process: its `finally` never runs. Every process of the cluster
    notices its parent's death (txflow.processes.lifeline) within 15 s, and on_crashed, which the worker runs,
    says in the run's logs what it stopped."""
    state = reaper.watch(tmp_path / "state")
    run_id = f"dep-crash-{uuid.uuid4().hex[:8]}"
    params = {"config": {**_config(tmp_path, run_id, steps=500), "processes": 1}}  # one rank: as above
    flow_run_id = _run_deployment(server, "train/sft", params, started_runs)
    _wait_training_started(state, flow_run_id, server, worker)
    pids = [pid for pid, _ in cluster_pids(state)]
    assert len(alive_pids(state)) == 2  # api, rank 0
    os.kill(_engine_pid(worker.pid, flow_run_id), signal.SIGKILL)
    killed_at = time.monotonic()
    while alive_pids(state) and time.monotonic() - killed_at < 15:
        time.sleep(0.2)
    gone_after = time.monotonic() - killed_at
    assert alive_pids(state) == [], f"cluster alive {gone_after:.1f} s after the crash:\n{worker.tail()}"
    print(f"crash -> cluster gone in {gone_after:.1f} s")
    run = _wait_final(server, flow_run_id, worker, deadline_s=300)
    assert run.state.is_crashed(), f"{run.state.name}: {run.state.message}"
    # The worker runs the hook in a fresh process after reporting Crashed; its line names each process.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        hook_lines = [line for line in _flow_run_logs(server, flow_run_id)
                      if "Crashed hook: stopped the cluster" in line]
        if hook_lines:
            break
        time.sleep(1)
    assert hook_lines, worker.tail()
    assert all(f"pid {pid} " in hook_lines[0] for pid in pids), hook_lines


def test_nightly_validation_fails_loudly(server, worker, tmp_path, reaper, started_runs):
    """Both runs fail their preflight: the nightly flow run must end Failed, naming both."""
    bad = {"base_model": str(tmp_path / "no-such-model"), "checkpoints": str(tmp_path / "ckpt")}
    params = {"sft": {"mode": "sft", "base_model": "tiny", "steps": 6, **bad,
                      "state_dir": str(reaper.watch(tmp_path / "sft"))},
              "rl": {"mode": "rl", "base_model": "tiny", "steps": 6, **bad,
                     "state_dir": str(reaper.watch(tmp_path / "rl"))}}
    flow_run_id = _run_deployment(server, "nightly-validation/nightly", params, started_runs)
    run = _wait_final(server, flow_run_id, worker, deadline_s=300)
    assert run.state.is_failed(), f"{run.state.name}: {run.state.message}\n{worker.tail()}"
    message = run.state.message or ""
    assert "nightly validation FAILED" in message and "sft run" in message and "rl run" in message, message
    assert "no such directory" in message



def test_the_sweep_deployment_trains_its_members_as_subflows_and_publishes_the_ranking(server, worker, tmp_path,
                                                                                         reaper, started_runs):
    """`sweep/lr` with the tiny model: its own cluster, two members side by side, the ranking artifact on the
    server, the best promoted, and the cluster stopped when the sweep ends."""
    sweep_id = f"dsw-{uuid.uuid4().hex[:6]}"
    clusters = REPO / ".txflow" / "clusters" / sweep_id  # the worker's working directory is the checkout
    reaper.watch(clusters)
    config = {"mode": "sft", "base_model": "tiny", "steps": 4, "save_every": 0, "processes": 1,
              "export": {"enabled": True}, "checkpoints": str(tmp_path / "ckpt"), "state_dir": str(tmp_path / "sweep")}
    try:
        flow_run_id = _run_deployment(server, "sweep/lr", {"config": config, "learning_rates": [1e-2, 2e-2],
                                                           "sweep_id": sweep_id}, started_runs)
        run = _wait_final(server, flow_run_id, worker)
        assert run.state.is_completed(), f"{run.state.name}: {run.state.message}\n{worker.tail()}"
        ranking = json.loads((tmp_path / "sweep" / "ranking.json").read_text())
        members = [f"{sweep_id}-00", f"{sweep_id}-01"]
        assert sorted(r["run_id"] for r in ranking["members"]) == members and ranking["failed"] == []
        assert ranking["promoted"]["name"] == "sweep-best" and ranking["promoted"]["run_id"] == ranking["best"]
        assert f"ranking-{sweep_id}" in _artifacts(server, flow_run_id)
        with api(server) as client:
            from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

            children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[uuid.UUID(flow_run_id)])))
        assert sorted(c.parameters["config"]["run_id"] for c in children) == members
        assert all(c.state.is_completed() for c in children)
        assert json.loads((clusters / "serves.json").read_text())["state"] == "down"
    finally:
        shutil.rmtree(clusters, ignore_errors=True)


def _artifacts(server: Server, flow_run_id: str) -> dict[str, object]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with api(server) as client:
        found = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(flow_run_id)])))
    return {a.key: a for a in found if a.key}


def test_the_nightly_compares_tonight_with_the_history_and_fails_on_a_regression(server, worker, tmp_path, reaper,
                                                                                  started_runs):
    """Night 1: SFT passes, RL fails (its reward cannot be imported): the nightly fails naming the RL run.
    Then the history gets three earlier passing nights with far shorter SFT timings, so that night 2
    (SFT alone) is slower on each: it fails and names the figures. (A failed night forming no
    baseline, and too little history passing, are unit tests in test_history.)"""
    from txflow.reporting import history

    root = str(tmp_path / "history")
    # The tiny model on one JAX process: the comparison with the history is what is under test (the nightly's runs
    # of the real model are test_real_model_e2e's), and it halves two runs' CPU.
    sft = {**NIGHTLY_SFT, "base_model": "tiny", "processes": 1, "checkpoints": str(tmp_path / "ckpt"),
           "state_dir": str(tmp_path / "sft")}
    rl = {"mode": "rl", "base_model": "tiny", "steps": 2, "rl": {"reward": "nowhere_xyz:fn"},
          "checkpoints": str(tmp_path / "ckpt"),
          "state_dir": str(tmp_path / "rl")}

    def night(params: dict, name: str):
        reaper.watch(tmp_path / name)
        params = {**params, "sft": {**params["sft"], "run_id": f"nightly-{name}",
                                    "state_dir": str(tmp_path / name)}}
        flow_run_id = _run_deployment(server, "nightly-validation/nightly", params, started_runs)
        return flow_run_id, _wait_final(server, flow_run_id, worker, deadline_s=RUN_DEADLINE_S)

    # Night 1: one run fails, the other passes.
    first_id, first = night({"sft": sft, "rl": rl, "history_root": root}, "n1")
    assert first.state.is_failed(), f"{first.state.name}: {first.state.message}"
    assert "rl run" in first.state.message and "cannot import module" in first.state.message
    assert "sft run" not in first.state.message
    summary = _artifacts(server, first_id)["nightly-validation"].data
    assert "**FAILED**" in summary and "| sft | `nightly-n1` | passed |" in summary
    assert re.search(r"\| rl \| `nightly-rl-[^`]+` \| failed \| .*cannot import module", summary)

    # Three earlier passing nights whose SFT timings were all 0.1 s: every real timing tonight is past the
    # limit (0.1 s plus the 0.5 s floor). A fraction of night 1's figures would not do: night 1 starts its
    # cluster beside the RL run, and night 2's start, alone and warm, came in under a third of it on CI.
    records, problems = history.read(root)
    assert problems == [] and [r.status for r in records] == ["failed"]
    earlier = records[-1]
    sft_figures = {k: v for k, v in earlier.figures.items() if k.startswith("sft.")}
    assert {"sft.final_eval_loss", "sft.eval_loss_gain", "sft.median_step_s", "sft.startup_s"} <= set(sft_figures)
    fast = {k: (0.1 if k.endswith("_s") else v) for k, v in sft_figures.items()}
    for days in (3, 2, 1):
        history.append(root, history.NightlyRecord(
            started_at=earlier.started_at - timedelta(days=days, hours=1),
            versions=earlier.versions, figures=fast, status="passed"))
    second_id, second = night({"sft": sft, "modes": ["sft"], "history_root": root}, "n2")
    assert second.state.is_failed(), f"{second.state.name}: {second.state.message}\n{worker.tail()}"
    message = second.state.message
    assert "sft.startup_s regressed: tonight" in message and "sft.total_s regressed" in message, message
    artifacts = _artifacts(server, second_id)
    summary = artifacts["nightly-validation"].data
    assert "regression" in summary and "**sft.startup_s**" in summary
    assert "data:image/png;base64," in summary  # the trend
    rows = artifacts["nightly-validation-figures"].data
    rows = json.loads(rows) if isinstance(rows, str) else rows
    by_figure = {row["figure"]: row for row in rows}
    assert by_figure["sft.startup_s"]["verdict"] == "REGRESSION", by_figure["sft.startup_s"]
    assert history.read(root)[0][-1].status == "regression"
