"""The `train` flow: provision-coordinator -> launch-workers -> train ->
save-checkpoint -> discover-artifacts -> evaluate-restore (-> evaluate, with
`eval_task`), teardown of every
process whatever happens, then, with no cluster left: export-adapter,
prune-checkpoints (keep_last), the approval (approve) and promote
(promote_as), each only when everything before it passed.

A cluster fault (a rank that dies, a request without progress for
`step_timeout_s`) tears the cluster down and continues on a freshly
provisioned one, up to `train_retries` times (a run attached to a shared
cluster attaches again once that is back up, or, with `cluster_fallback` own,
provisions a cluster of its own). A retry redoes only what the
fault interrupted: training resumes from the last durable step, a fault after
training resumes at the failed step from the committed final state, and a
custom client (which only knows how to start) runs again. Every such failure,
and where the retry resumed, is in the report."""

from __future__ import annotations

import time
import traceback
from contextlib import ExitStack, contextmanager

from prefect import Flow, flow
from prefect.concurrency.sync import concurrency

from tasks.approve import approval
from tasks.discover_artifacts import discover_artifacts
from tasks.evaluate import evaluate
from tasks.evaluate_restore import evaluate_restore
from tasks.export_adapter import export_adapter
from tasks.launch_workers import launch_workers
from tasks.preflight import preflight
from tasks.promote import promote
from tasks.provision_coordinator import provision_coordinator
from tasks.prune_checkpoints import prune_checkpoints
from tasks.save_checkpoint import save_checkpoint
from tasks.teardown import teardown
from tasks.train import train
from txflow.checkpoints import lease, storage
from txflow.checkpoints.export import failure as export_failure
from txflow.checkpoints.promotion import Promotion
from txflow.cluster import embedded_prefect, named
from txflow.cluster.handle import ClusterHandle
from txflow.cluster.launchers import get_launcher, stop_cluster
from txflow.cluster.monitor import Failure, NoProgress
from txflow.cluster.records import as_json
from txflow.config import SECRET_FIELDS, RunConfig
from txflow.log import get_logger, register_run_secrets
from txflow.preflight import Checked, PreflightError
from txflow.processes.umask import private_files
from txflow.reporting import report as run_report
from txflow.reporting import tracking
from txflow.reporting.metrics import metrics_path
from txflow.reporting.report import RunReport
from txflow.results import Progress
from txflow.training import evaluation


class RunFailed(RuntimeError):
    """The run finished but a step or the restore check failed; the report says which."""

    def __init__(self, report: RunReport):
        super().__init__(f"run {report.run_id} {report.status}: {report.error}")
        self.report = report


def _with_run_id(config: RunConfig, flow_run) -> RunConfig:
    """`config`, with a run_id derived from the Prefect flow run when it has none, so that the
    hooks (which only see the flow run) compute the same state_dir as the flow."""
    if config.run_id is not None or flow_run is None:
        return config
    return config.model_copy(
        update={"run_id": f"{config.mode}-{flow_run.created:%Y%m%d-%H%M%S}-{flow_run.id.hex[:4]}"})


def _stop_cluster_hook(flow, flow_run, state) -> None:
    """on_cancellation / on_crashed: the flow's own finally may not run, so stop from cluster.json."""
    from prefect.logging.loggers import flow_run_logger

    config = flow_run.parameters.get("config") or {}
    if isinstance(config, dict):
        # Prefect keeps a secret parameter as "**********", which would fail validation; the stop needs
        # only where the run's state lives, never a secret.
        cfg = RunConfig.model_validate({k: v for k, v in config.items() if k not in SECRET_FIELDS})
    else:
        cfg = config
    cfg = _with_run_id(cfg, flow_run).resolved()
    records = stop_cluster(cfg.state_dir)
    if cfg.cluster:
        # Attached to a shared cluster: its key goes; its adapters are freed when its sessions stop beating.
        named.revoke(cfg.cluster, cfg.run_id)
    flow_run_logger(flow_run, flow).info(
        f"{state.name} hook: stopped the cluster in {cfg.state_dir}: "
        + (", ".join(f"{r.role} pid {r.pid} exit {r.exit_text}" for r in records) or "nothing recorded"))


@contextmanager
def cluster_slots(cfg: RunConfig):
    """Hold `processes` slots of the Prefect global concurrency limit while the run has a cluster.

    On the embedded server of `txflow run` (it lives for this run) there is nothing to share: no guard, no
    word. On a real server the limit must exist: the default one, missing, gets one warning with the
    command that creates it and no guard; a limit named on purpose, missing (misspelled, say), stops the
    run before anything starts, since it would otherwise silently guard nothing."""
    name = cfg.concurrency_limit
    if not name or embedded_prefect.is_embedded() or cfg.cluster:  # a shared cluster's holder holds its slots
        yield
        return
    if not _limit_exists(name):
        create = f"prefect gcl create {name} --limit N (N: the ranks your machines can hold at once)"
        if name != RunConfig.model_fields["concurrency_limit"].default:
            raise PreflightError(f"--concurrency-limit {name}: the Prefect server has no global concurrency limit of "
                                 f"that name, so it would guard nothing. Create it: {create}; or pass an empty value "
                                 f"for no guard")
        _warn_once(f"runs are not kept apart: the Prefect server has no global concurrency limit {name!r}. "
                   f"Create it: {create}; or set concurrency_limit to empty to say you want none")
        yield
        return
    with concurrency(name, occupy=cfg.processes, strict=True):
        yield


def _limit_exists(name: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return True
        except ObjectNotFound:
            return False


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        get_logger().warning(message)


def _steps(cfg: RunConfig, handle: ClusterHandle, data, done: Progress) -> None:
    """The steps after the cluster is up, skipping those an earlier attempt finished."""
    if done.trained is None:
        done.train_runs += 1
        done.trained = done.run(train, cfg, handle, data, done.train_runs)
    if done.saved is None:
        done.saved = done.run(save_checkpoint, cfg, handle, done.trained)
    if done.discovered is None:
        done.discovered = done.run(discover_artifacts, cfg, done.saved)
    done.restore = done.run(evaluate_restore, cfg, handle, done.trained.metrics, done.saved, data)
    if cfg.eval_task and done.restore.passed and done.evaluation is None:
        done.evaluation = done.run(evaluate, cfg, handle, done.saved)


def checked_train_flow(checked: Checked | None = None) -> Flow:
    """The `train` flow. `checked`: what pre-flight found for the config the flow will be called with, when the
    caller checked it already (`txflow run` checks before it starts Prefect: bad input exits at once); the
    flow's preflight step takes it instead of checking again. Without it (a deployment, a sweep member), the
    flow checks its config itself."""

    @flow(name="train", on_cancellation=[_stop_cluster_hook], on_crashed=[_stop_cluster_hook])
    def train_flow(config: RunConfig = RunConfig()) -> RunReport:
        """Fine-tune a LoRA adapter on a SkyRL-tx cluster and prove the checkpoint restores."""
        from prefect.context import FlowRunContext

        cfg = _with_run_id(config, getattr(FlowRunContext.get(), "flow_run", None)).resolved()
        with private_files():  # the run's files and every process it starts: owner only
            return _train(cfg, checked)

    return train_flow


# What deployments, sweeps and the nightly run (prefect.yaml's entrypoint).
train_flow = checked_train_flow()


def _train(cfg: RunConfig, checked: Checked | None) -> RunReport:
    """The body of the `train` flow, with the run config resolved."""
    log = get_logger()
    register_run_secrets(cfg)
    log.info(f"run {cfg.run_id}: mode {cfg.mode}, {cfg.processes} processes on the {cfg.launcher} launcher, "
             f"root {cfg.run_root}, state {cfg.state_dir}")
    log.info(cfg.defaults_line())
    done = Progress()
    began = time.monotonic()
    checked = done.time(preflight, cfg, checked)
    # The run root says the run is running (for `txflow prune`, maybe elsewhere) until it ends. `txflow run`
    # took it already, before the flow started: joined.
    with lease.held(cfg.run_root, cfg.run_id, cfg.plain_storage_options(), join=True):
        return _run(cfg, checked, done, began)


def _run(cfg: RunConfig, checked: Checked, done: Progress, began: float) -> RunReport:
    """The steps after pre-flight, the report, and the run's verdict."""
    log = get_logger()
    launcher = get_launcher(cfg)
    # What the run is after its shared cluster failed it, with `cluster_fallback` own: a run of its own, with a
    # database of its own (SQLite in its state directory; a database it was given is the shared cluster's).
    own = cfg.model_copy(update={"cluster": None, "cluster_fallback": "wait", "database_url": None})
    if cfg.cluster:
        cfg = named.attached_config(cfg)  # checkpoints it imports are registered in the cluster's database
    error = None
    with ExitStack() as slots:
        slots.enter_context(cluster_slots(cfg))
        for attempt in range(cfg.train_retries + 1):
            handle = None
            try:
                handle = done.run(provision_coordinator, cfg, launcher, checked.base_model_path)
                done.run(launch_workers, cfg, handle, _readiness_prompts(cfg, checked.data))
                _steps(cfg, handle, checked.data, done)
                error = None
            except Exception as exc:
                error = "".join(traceback.format_exception_only(exc)).strip()
                fault = _cluster_fault(handle, exc)
                if fault is not None:
                    fault.step = done.step
                    done.failures.append(fault)
                if fault is None or attempt == cfg.train_retries:
                    log.error(f"run {cfg.run_id} failed in {done.step}: {error}")
                    break
                log.warning(f"cluster fault in {done.step} ({fault.message.splitlines()[0]}); tearing down and "
                            f"continuing on a fresh cluster ({attempt + 1}/{cfg.train_retries})")
            finally:
                try:
                    done.ranks = done.time(teardown, handle, cfg.state_dir)
                except BaseException:
                    done.ranks = as_json(handle.stop() if handle is not None else stop_cluster(cfg.state_dir))
                if handle is not None and handle.compiles is not None:  # stopped by the teardown: all it saw
                    for name, seconds in handle.compiles.timings().items():
                        done.timings[name] = round(done.timings.get(name, 0.0) + seconds, 3)
            if error is None:
                break
            _note_resume_point(cfg, done)
            if cfg.cluster and cfg.cluster_fallback == "own":
                # The shared cluster failed this run (released above, never touched again): from here on the run
                # has a cluster of its own, in its own database, and holds slots for it as such a run does.
                log.warning(f"run {cfg.run_id}: leaving cluster {cfg.cluster} (cluster_fallback own); the retry "
                            f"starts a cluster of its own")
                cfg = own
                slots.enter_context(cluster_slots(cfg))
    if error is None and done.restore and not done.restore.passed:
        error = "checks failed: " + "; ".join(done.restore.failed_checks)
    if error is None and done.restore and done.restore.passed and cfg.export.enabled:
        error = _export(cfg, done)
    if error is None and done.restore and done.restore.passed:
        error = _lifecycle(cfg, done)
    done.timings["total"] = round(time.monotonic() - began, 3)

    report = run_report.build(cfg, done, error)
    try:
        lease.check(cfg.run_root, cfg.plain_storage_options())
    except lease.LeaseLost as exc:  # the run root is another run's now: nothing more is written there
        report = run_report.build(cfg, done, error or str(exc))
        log.info(f"run {cfg.run_id} {report.status}; no report written under {cfg.run_root}")
    else:
        path = metrics_path(cfg.state_dir)
        run_report.write(cfg, report, path.read_text() if path.exists() else "")
        log.info(f"run {cfg.run_id} {report.status}; report {cfg.run_root}/report.json")
    run_report.publish_artifacts(report)
    tracking.log_run(cfg, report)
    if not report.passed:
        raise RunFailed(report)
    return report


def _export(cfg: RunConfig, done: Progress) -> str | None:
    """export-adapter, once the cluster is gone; the run's error when it fails (its check or itself)."""
    try:
        done.exported = done.run(export_adapter, cfg, done.restore)
    except Exception as exc:
        get_logger().error(f"run {cfg.run_id} failed in {done.step}: {exc}")
        return "".join(traceback.format_exception_only(exc)).strip()
    done.discovered = done.exported.discovered
    problem = export_failure(done.exported.result)
    return f"export check failed: {problem}" if problem else None


def _lifecycle(cfg: RunConfig, done: Progress) -> str | None:
    """A passed run: prune-checkpoints (keep_last), then approval (approve) and promote (promote_as). The
    run's error when a step fails; a rejection or an approval that never came is no error."""
    metrics = run_report.run_metrics(cfg, done)
    try:
        if cfg.export.keep_last:
            done.pruned = done.run(prune_checkpoints, cfg, done.discovered)
            done.discovered = done.pruned.discovered
        if not cfg.export.promote_as:
            return None
        decision = None
        if cfg.export.approve:
            summary = run_report.approval_markdown(cfg, metrics, done.restore, done.exported.result)
            decision = done.run(approval, cfg, summary)
            if decision.verdict != "approved":
                done.promoted = Promotion(name=cfg.export.promote_as, status=decision.verdict, comment=decision.comment,
                                          approver=decision.approver)
                return None
        done.promoted = done.run(promote, cfg, done.saved, done.restore, done.exported.result, metrics, decision)
    except Exception as exc:
        get_logger().error(f"run {cfg.run_id} failed in {done.step}: {exc}")
        if done.step == promote.name:
            done.promoted = Promotion(name=cfg.export.promote_as, status="failed")
        return "".join(traceback.format_exception_only(exc)).strip()
    return None


def _note_resume_point(cfg: RunConfig, done: Progress) -> None:
    """Record on the last failure where the retry picks up."""
    failure = done.failures[-1]
    if done.trained is None:
        failure.resumed_at = train.name
        if cfg.mode != "custom":
            latest = storage.latest_state(cfg.run_root, cfg.plain_storage_options())
            failure.resumed_from_step = storage.step_of(latest.path) if latest else 0
    else:
        failure.resumed_at = (save_checkpoint if done.saved is None else
                              discover_artifacts if done.discovered is None else evaluate_restore).name


def _cluster_fault(handle: ClusterHandle | None, exc: Exception) -> Failure | None:
    """The failure to continue from on a fresh cluster, or None when `exc` is not a cluster fault.

    A dead process is one (whatever error the request in flight surfaced first);
    so is a request that made no progress within its deadline.
    """
    if handle is not None:
        failure = handle.monitor.settle()  # a death the request surfaced before the monitor's next look
        if failure is not None:
            return failure
    if isinstance(exc, NoProgress):
        return Failure(rank=None, role="request", exit_code=None, detected_at=time.time(), message=str(exc))
    return None


def _readiness_prompts(cfg: RunConfig, data) -> list[list[int]] | None:
    """The held-out prompts the readiness sample answers with the base model (`tasks.launch_workers`), so that
    the live reference does not sample them again; a custom client's run has none."""
    return None if cfg.mode == "custom" or data is None else evaluation.eval_prompts(cfg.mode, data)
