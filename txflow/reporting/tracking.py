"""Runs tracked in MLflow: every run logs its parameters (its `RunConfig`, credentials left out), its per-step metrics,
its evaluations (the restore check's quality figures and the export's proof), its report and curve, and the path of
the adapter it exported; a sweep is one run with its members as children.

Through MLflow's client (mlflow-skinny), one run at a time per call and no global state: a sweep's members log from
threads of one process. By default into `sqlite:///.txflow/mlflow.db` in the working directory (every run of a
checkout in one store, which `make mlflow-ui` shows), its artifacts in
`.txflow/mlflow-artifacts/`. Tracking is a record, not a check: a store that cannot be written is a warning, never a
failed run."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from txflow.config import FLAT_NAMES, SECRET_FIELDS, RunConfig
from txflow.log import get_logger, scrub

TRACKING_URI_ENV = "TXFLOW_TRACKING_URI"
OFF = "off"
EXPERIMENT = "txflow"
DEFAULT_DB = Path(".txflow") / "mlflow.db"


def tracking_uri(cfg: RunConfig) -> str | None:
    """Where the run logs to; None when tracking is off."""
    return store_uri(cfg.tracking_uri)


def store_uri(given: str | None) -> str | None:
    """The store `given` names, else $TXFLOW_TRACKING_URI, else the checkout's database; None for `off`."""
    uri = given or os.environ.get(TRACKING_URI_ENV) or f"sqlite:///{DEFAULT_DB.absolute()}"
    return None if uri.strip().lower() == OFF else uri


def _experiment(uri: str):
    """(client, experiment id) of txflow's experiment in the store at `uri`, created on first use; a store in a
    local database keeps its artifacts in a folder beside it (MLflow would use ./mlruns of whatever directory the
    process runs in)."""
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(EXPERIMENT)
    if found is not None:
        return client, found.experiment_id
    location = None
    if uri.startswith("sqlite:///"):
        location = (Path(uri.removeprefix("sqlite:///")).parent / "mlflow-artifacts").absolute().as_uri()
    try:
        return client, client.create_experiment(EXPERIMENT, artifact_location=location)
    except Exception:  # another run created it a moment ago
        return client, client.get_experiment_by_name(EXPERIMENT).experiment_id


def params_of(cfg: RunConfig) -> dict[str, str]:
    """The run's options as MLflow parameters: nested models flattened (`mesh.tp`), the option groups' under
    the flat names a person types (`group_size`, not `rl.group_size`), no credential."""
    flat: dict[str, str] = {}

    def add(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}.{key}" if prefix else key, inner)
        else:
            flat[prefix] = scrub(json.dumps(value) if isinstance(value, list | dict) else str(value))[:6000]

    add("", cfg.model_dump(mode="json", exclude=set(SECRET_FIELDS) | {"tracking_uri", "tracking_parent"}))
    typed = {".".join(path): name for name, path in FLAT_NAMES.items()}
    return {typed.get(key, key): value for key, value in flat.items()}


def _numbers(values: dict) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and v == v}  # NaN logs nothing


def metrics_of(report) -> list[tuple[str, float, int]]:
    """(key, value, step): every numeric figure of every training step, then the evaluations (`eval/...`, the
    restore check's quality figures) and the export's proof (`export/...`) at the last step."""
    rows = []
    for row in report.metrics:
        step = int(row.get("step", 0))
        rows += [(key, value, step) for key, value in _numbers(row).items() if key != "step"]
    last = max((step for _, _, step in rows), default=0)
    rows += [(f"eval/{key}", value, last) for key, value in _numbers(report.restore or {}).items()]
    evaluation = getattr(report, "evaluation", None)
    if evaluation:  # the harness's scores: the trained adapter's, and the base model's beside it
        base, *trained = evaluation["scores"]
        rows += [(f"eval/{evaluation['task']}/base_accuracy", base["accuracy"], last)]
        rows += [(f"eval/{evaluation['task']}/accuracy", s["accuracy"], last) for s in trained]
    if report.export is not None:
        rows += [(f"export/{key}", value, last) for key, value in _numbers(report.export.model_dump()).items()]
    return rows


def log_run(cfg: RunConfig, report) -> str | None:
    """Log a finished run; its MLflow run id, or None when tracking is off or the store failed (a warning)."""
    uri = tracking_uri(cfg)
    if uri is None:
        return None
    try:
        return _log_run(uri, cfg, report)
    except Exception as exc:  # a record, not a check: the run stands
        get_logger().warning(f"MLflow: run {cfg.run_id} not tracked at {scrub(uri)} ({type(exc).__name__}: "
                             f"{scrub(str(exc)).splitlines()[0] if str(exc) else ''})")
        return None


def _log_run(uri: str, cfg: RunConfig, report) -> str:
    from mlflow.entities import Metric, RunTag

    from txflow.reporting.report import curve_png

    client, experiment = _experiment(uri)
    tags = {"txflow.mode": cfg.mode, "txflow.status": report.status, "txflow.base_model": report.base_model,
            "txflow.run_root": report.checkpoint_root}
    if report.export is not None and report.export.peft_url:
        tags["txflow.adapter"] = report.export.peft_url
    if cfg.tracking_parent:
        tags["mlflow.parentRunId"] = cfg.tracking_parent
    run_id = client.create_run(experiment, run_name=cfg.run_id, tags=tags).info.run_id
    _log_params(client, run_id, params_of(cfg))
    now = int(time.time() * 1000)
    metrics = [Metric(key, value, now, step) for key, value, step in metrics_of(report)]
    for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
        client.log_batch(run_id, metrics=metrics[i:i + 1000], tags=[RunTag("txflow.steps", str(len(report.metrics)))])
    with tempfile.TemporaryDirectory(prefix="txflow-mlflow-") as tmp:
        (Path(tmp) / "report.json").write_text(report.to_json())
        curve = curve_png(report.metrics)
        if curve:
            (Path(tmp) / "curve.png").write_bytes(curve)
        client.log_artifacts(run_id, tmp)
    client.set_terminated(run_id, "FINISHED" if report.status == "passed" else "FAILED")
    get_logger().info(f"MLflow: run {cfg.run_id} tracked as {run_id} at {scrub(uri)}")
    return run_id


def _log_params(client, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), 100):  # MLflow's limit per batch
        client.log_batch(run_id, params=items[i:i + 100])


def start_sweep(cfg: RunConfig, sweep_id: str, grid: dict) -> str | None:
    """The MLflow run of a sweep, its members' parent; None when tracking is off or the store failed."""
    uri = tracking_uri(cfg)
    if uri is None:
        return None
    try:
        client, experiment = _experiment(uri)
        run_id = client.create_run(experiment, run_name=f"sweep {sweep_id}",
                                   tags={"txflow.mode": cfg.mode, "txflow.sweep": sweep_id}).info.run_id
        _log_params(client, run_id, {**params_of(cfg), **{k: json.dumps(v) for k, v in grid.items()}})
        return run_id
    except Exception as exc:
        get_logger().warning(f"MLflow: sweep {sweep_id} not tracked at {scrub(uri)} ({type(exc).__name__})")
        return None


def finish_sweep(cfg: RunConfig, run_id: str | None, ranking: dict) -> None:
    """The sweep's ranking as its run's artifact, the best member named, the run ended."""
    uri = tracking_uri(cfg)
    if uri is None or run_id is None:
        return
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        client.log_dict(run_id, ranking, "ranking.json")
        if ranking.get("best"):
            client.set_tag(run_id, "txflow.best", ranking["best"])
        client.set_terminated(run_id, "FINISHED" if ranking.get("best") else "FAILED")
    except Exception as exc:
        get_logger().warning(f"MLflow: the sweep's run {run_id} not finished ({type(exc).__name__})")


def log_eval(uri: str | None, report: dict, run_roots: dict[str, str]) -> str | None:
    """`txflow eval`'s scores: a run of their own (`eval <task>`: each model's accuracy, eval.json), and on the
    training run of each adapter (found by its run root, `run_roots`: model name -> root) its score and the base
    model's beside its own metrics. The eval run's id, or None when tracking is off or the store failed."""
    if uri is None:
        return None
    try:
        from mlflow.entities import Metric

        client, experiment = _experiment(uri)
        now = int(time.time() * 1000)
        task = report["task"]
        accuracy = {s["model"]: s["accuracy"] for s in report["scores"]}
        run_id = client.create_run(experiment, run_name=f"eval {task}", tags={
            "txflow.mode": "eval", "txflow.task": task, "txflow.harness": report["harness"]}).info.run_id
        client.log_batch(run_id, metrics=[Metric(f"eval/{task}/{model}/accuracy", value, now, 0)
                                          for model, value in accuracy.items()])
        client.log_dict(run_id, report, "eval.json")
        client.set_terminated(run_id, "FINISHED")
        base = next(iter(accuracy))  # the base model is scored first
        for model, root in run_roots.items():
            trained = client.search_runs([experiment], f"tags.`txflow.run_root` = '{root}'", max_results=1,
                                         order_by=["attributes.start_time DESC"])
            if trained:
                client.log_batch(trained[0].info.run_id, metrics=[
                    Metric(f"eval/{task}/accuracy", accuracy[model], now, 0),
                    Metric(f"eval/{task}/base_accuracy", accuracy[base], now, 0)])
        get_logger().info(f"MLflow: the evaluation tracked as {run_id} at {scrub(uri)}")
        return run_id
    except Exception as exc:  # a record, not a check: the scores stand
        get_logger().warning(f"MLflow: the evaluation not tracked at {scrub(uri)} ({type(exc).__name__})")
        return None
