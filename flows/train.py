"""The `train` flow: provision-coordinator -> launch-workers -> train ->
save-checkpoint -> discover-artifacts -> evaluate-restore, and teardown of
every process whatever happens."""

from __future__ import annotations

import time
import traceback

from prefect import flow

from tasks.discover_artifacts import discover_artifacts
from tasks.evaluate_restore import evaluate_restore
from tasks.launch_workers import launch_workers
from tasks.provision_coordinator import provision_coordinator
from tasks.save_checkpoint import save_checkpoint
from tasks.teardown import teardown
from tasks.train import train
from txflow import report as run_report
from txflow.cluster import LocalLauncher, as_json, stop_cluster
from txflow.config import RunConfig
from txflow.log import get_logger, register_run_secrets
from txflow.preflight import prepare
from txflow.run_files import metrics_path, read_metrics


class RunFailed(RuntimeError):
    """The run finished but a step or the restore check failed; the report says which."""

    def __init__(self, report: dict):
        super().__init__(f"run {report['run_id']} {report['status']}: {report['error'] or 'restore check failed'}")
        self.report = report


def _stop_cluster_hook(flow, flow_run, state) -> None:
    """on_cancellation / on_crashed: the flow's own finally may not run, so stop from cluster.json."""
    config = flow_run.parameters.get("config") or {}
    cfg = RunConfig.model_validate(config) if isinstance(config, dict) else config
    if cfg.state_dir:
        stop_cluster(cfg.state_dir)


@flow(name="train", on_cancellation=[_stop_cluster_hook], on_crashed=[_stop_cluster_hook])
def train_flow(config: RunConfig = RunConfig()) -> dict:
    """Fine-tune a LoRA adapter on a SkyRL-tx cluster and prove the checkpoint restores."""
    cfg = config.resolved()
    log = get_logger()
    register_run_secrets(cfg)
    log.info(f"run {cfg.run_id}: mode {cfg.mode}, {cfg.processes} processes, root {cfg.run_root}, "
             f"state {cfg.state_dir}")
    timings: dict[str, float] = {}
    began = time.monotonic()

    def timed(name, fn, *args, **kwargs):
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            timings[name] = round(time.monotonic() - start, 3)

    data = timed("preflight", prepare, cfg)
    launcher = LocalLauncher()
    trained = saved = discovered = restore = None
    error = None
    ranks: list[dict] = []
    try:
        cluster = timed("provision-coordinator", provision_coordinator, cfg, launcher)
        cluster = timed("launch-workers", launch_workers, cfg, cluster, launcher)
        trained = timed("train", train.with_options(retries=cfg.train_retries), cfg, cluster, launcher, data)
        saved = timed("save-checkpoint", save_checkpoint, cfg, cluster, launcher, trained, data)
        discovered = timed("discover-artifacts", discover_artifacts, cfg, saved)
        restore = timed("evaluate-restore", evaluate_restore, cfg, cluster, launcher, trained.metrics, saved, data)
    except Exception as exc:
        error = "".join(traceback.format_exception_only(exc)).strip()
        log.error(f"run {cfg.run_id} failed: {error}")
    finally:
        try:
            ranks = timed("teardown", teardown, cfg.state_dir, launcher)
        except BaseException:
            ranks = as_json(stop_cluster(cfg.state_dir, launcher))
    timings["total"] = round(time.monotonic() - began, 3)

    status = "passed" if error is None and restore and restore["passed"] else "failed"
    metrics = trained.metrics if trained else read_metrics(cfg.state_dir)
    report = run_report.build(cfg, status, timings, metrics, saved, discovered, restore, ranks, error,
                              trained.resumed_from_step if trained else 0)
    path = metrics_path(cfg.state_dir)
    run_report.write(cfg, report, path.read_text() if path.exists() else "")
    run_report.publish_artifacts(report)
    log.info(f"run {cfg.run_id} {status}; report {cfg.run_root}/report.json")
    if status != "passed":
        raise RunFailed(report)
    return report
