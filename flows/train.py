"""The `train` flow: provision-coordinator -> launch-workers -> train ->
save-checkpoint -> discover-artifacts -> evaluate-restore, and teardown of
every process whatever happens.

A cluster fault (a rank that dies, a request without progress for
`step_timeout_s`) tears the cluster down and runs the steps again on a freshly
provisioned one, resuming from the last durable state, up to `train_retries`
times. Every such failure is in the report."""

from __future__ import annotations

import time
import traceback
from contextlib import contextmanager

from prefect import flow
from prefect.concurrency.sync import concurrency

from tasks.discover_artifacts import discover_artifacts
from tasks.evaluate_restore import evaluate_restore
from tasks.launch_workers import launch_workers
from tasks.provision_coordinator import provision_coordinator
from tasks.save_checkpoint import save_checkpoint
from tasks.teardown import teardown
from tasks.train import train
from txflow import report as run_report
from txflow import storage
from txflow.cluster import LocalLauncher, as_json, stop_cluster
from txflow.config import RunConfig
from txflow.log import get_logger, register_run_secrets
from txflow.monitor import Failure, RankMonitor
from txflow.preflight import prepare
from txflow.run_files import metrics_path, read_metrics


class RunFailed(RuntimeError):
    """The run finished but a step or the restore check failed; the report says which."""

    def __init__(self, report: dict):
        super().__init__(f"run {report['run_id']} {report['status']}: {report['error'] or 'restore check failed'}")
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
    cfg = RunConfig.model_validate(config) if isinstance(config, dict) else config
    cfg = _with_run_id(cfg, flow_run).resolved()
    records = stop_cluster(cfg.state_dir)
    flow_run_logger(flow_run, flow).info(
        f"{state.name}: stopped the cluster in {cfg.state_dir}: "
        + (", ".join(f"{r.role} pid {r.pid} exit {r.exit_code}" for r in records) or "nothing recorded"))


@contextmanager
def cluster_slots(cfg: RunConfig):
    """Hold `processes` slots of the Prefect global concurrency limit while the run has a cluster."""
    if not cfg.concurrency_limit:
        yield
        return
    # strict=False: without the limit on the server (the embedded API) there is nothing to wait for.
    with concurrency(cfg.concurrency_limit, occupy=cfg.processes, strict=False):
        yield


class Timings(dict):
    """Seconds per step; a step that runs on several clusters adds up."""

    def run(self, name, fn, *args, **kwargs):
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self[name] = round(self.get(name, 0.0) + time.monotonic() - start, 3)


@flow(name="train", on_cancellation=[_stop_cluster_hook], on_crashed=[_stop_cluster_hook])
def train_flow(config: RunConfig = RunConfig()) -> dict:
    """Fine-tune a LoRA adapter on a SkyRL-tx cluster and prove the checkpoint restores."""
    from prefect.context import FlowRunContext

    cfg = _with_run_id(config, getattr(FlowRunContext.get(), "flow_run", None)).resolved()
    log = get_logger()
    register_run_secrets(cfg)
    log.info(f"run {cfg.run_id}: mode {cfg.mode}, {cfg.processes} processes, root {cfg.run_root}, "
             f"state {cfg.state_dir}")
    timings = Timings()
    began = time.monotonic()
    data = timings.run("preflight", prepare, cfg)
    launcher = LocalLauncher()
    trained = saved = discovered = restore = None
    error = None
    ranks: list[dict] = []
    failures: list[Failure] = []
    with cluster_slots(cfg):
        for attempt in range(cfg.train_retries + 1):
            monitor = None
            try:
                cluster = timings.run("provision-coordinator", provision_coordinator, cfg, launcher)
                cluster = timings.run("launch-workers", launch_workers, cfg, cluster, launcher)
                monitor = RankMonitor(cluster, launcher).start()
                trained = timings.run("train", train, cfg, cluster, launcher, data)
                saved = timings.run("save-checkpoint", save_checkpoint, cfg, cluster, launcher, trained, data)
                discovered = timings.run("discover-artifacts", discover_artifacts, cfg, saved)
                restore = timings.run("evaluate-restore", evaluate_restore, cfg, cluster, launcher, trained.metrics,
                                      saved, data)
                error = None
            except Exception as exc:
                error = "".join(traceback.format_exception_only(exc)).strip()
                fault = _cluster_fault(monitor, exc)
                if fault is None or attempt == cfg.train_retries:
                    log.error(f"run {cfg.run_id} failed: {error}")
                    if fault is not None:
                        failures.append(fault)
                    break
                failures.append(fault)
                log.warning(f"cluster fault ({fault.message.splitlines()[0]}); tearing down and retrying on a fresh "
                            f"cluster ({attempt + 1}/{cfg.train_retries})")
            finally:
                if monitor is not None:
                    monitor.stop()
                try:
                    ranks = timings.run("teardown", teardown, cfg.state_dir, launcher)
                except BaseException:
                    ranks = as_json(stop_cluster(cfg.state_dir, launcher))
            if error is None:
                break
            latest = storage.latest_state(cfg.run_root, cfg.plain_storage_options())
            failures[-1].resumed_from_step = storage.step_of(latest.path) if latest else 0
    timings["total"] = round(time.monotonic() - began, 3)

    status = "passed" if error is None and restore and restore["passed"] else "failed"
    metrics = trained.metrics if trained else read_metrics(cfg.state_dir)
    report = run_report.build(cfg, status, dict(timings), metrics, saved, discovered, restore, ranks, error,
                              trained.resumed_from_step if trained else 0, [f.as_dict() for f in failures])
    path = metrics_path(cfg.state_dir)
    run_report.write(cfg, report, path.read_text() if path.exists() else "")
    run_report.publish_artifacts(report)
    log.info(f"run {cfg.run_id} {status}; report {cfg.run_root}/report.json")
    if status != "passed":
        raise RunFailed(report)
    return report


def _cluster_fault(monitor: RankMonitor | None, exc: Exception) -> Failure | None:
    """The failure to retry on a fresh cluster, or None when `exc` is not a cluster fault.

    A dead process is one (whatever error the request in flight surfaced first);
    so is a request that made no progress within its deadline.
    """
    if monitor is not None:
        known = len(monitor.failures)
        monitor.poll()
        dead = [f for f in monitor.failures if f.role != "api"] or monitor.failures
        if dead and (monitor.failed.is_set() or len(monitor.failures) > known):
            return dead[0]
    if isinstance(exc, TimeoutError):
        return Failure(rank=None, role="request", exit_code=None, detected_at=time.time(), message=str(exc))
    return None
