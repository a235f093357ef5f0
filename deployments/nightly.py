"""The `nightly-validation` flow: a short SFT run and a short RL run of `train` as
subflows, then tonight's figures against the nights before (`txflow.reporting.history`).

It fails (Failed state, the reasons in its message and in the `nightly-validation`
markdown artifact) when a run fails or misses its checks, or when a figure is worse
than the trailing nights beyond their own noise. Every night appends one record to
the history, failed nights included (they never form a baseline).

Deployed as `nightly-validation/nightly` from prefect.yaml with a cron schedule.
"""

from __future__ import annotations

import base64
import time
import traceback
from typing import Literal

from prefect import flow

from deployments.defaults import NIGHTLY_RL, NIGHTLY_SFT
from flows.train import RunFailed, train_flow
from tasks.launch_workers import launch_workers
from tasks.provision_coordinator import provision_coordinator
from tasks.save_checkpoint import save_checkpoint
from txflow.cluster.launchers import stop_cluster
from txflow.config import NIGHTLY_HISTORY_DIR, RunConfig, new_run_id
from txflow.log import get_logger
from txflow.reporting import history
from txflow.reporting.report import RunReport

ARTIFACT_KEY = "nightly-validation"
HISTORY_DIR = NIGHTLY_HISTORY_DIR


class NightlyValidationFailed(RuntimeError):
    """A nightly run failed, or a figure regressed; the message says which and why."""


def _stop_subflow_clusters(flow, flow_run, state) -> None:
    """on_cancellation / on_crashed: the subflows share this process, so their own hooks may not run.

    Each subflow run records its resolved config (with an absolute state_dir) as
    its parameters; stop the cluster in each of those state directories.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.logging.loggers import flow_run_logger

    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id]))
        )
    # Hooks the worker runs log nothing by themselves: say what was stopped, for the UI.
    log = flow_run_logger(flow_run, flow)
    for child in children:
        config = child.parameters.get("config")
        state_dir = config.get("state_dir") if isinstance(config, dict) else None
        if state_dir:
            records = stop_cluster(state_dir)
            log.info(f"{state.name}: stopped the cluster of subflow run {child.name} in {state_dir}: "
                     + (", ".join(f"{r.role} pid {r.pid} exit {r.exit_text}" for r in records) or "nothing recorded"))


def figures_of_run(mode: str, report: RunReport) -> dict[str, float]:
    """The figures one run contributes to the night's record (`<mode>.<figure>`)."""
    restore = report.restore or {}
    values = {
        "restore_abs_diff": restore.get("abs_diff"),
        "startup_s": report.seconds(provision_coordinator, launch_workers) or None,
        "median_step_s": history.step_median(report.metrics),
        "save_s": report.timings_s.get(save_checkpoint.name),
        "total_s": report.timings_s.get("total"),
    }
    keys = {"sft": ("final_eval_loss", "eval_loss_gain"),
            "rl": ("eval_reward", "base_eval_reward", "reward_gain", "clip_fraction")}[mode]
    values.update({key: restore.get(key) for key in keys})
    return history.figures_of(mode, values)


def _runs_table(results: dict[str, dict]) -> list[str]:
    lines = ["", "## Runs", "", "| run | run id | status | error |", "|---|---|---|---|"]
    for mode, r in results.items():
        error = (r["error"] or "").replace("|", "\\|").replace("\n", " ")[-300:]
        lines.append(f"| {mode} | `{r['run_id']}` | {r['status']} | {error} |")
    return lines


def _publish(summary: str, comparisons: list, records: list) -> None:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    png = history.trend_png(records)
    if png is not None:
        # Inline, so the artifact (one key, every night) carries the trend up to that night.
        summary += f"\n\n![trend of the key figures](data:image/png;base64,{base64.b64encode(png).decode()})"
    create_markdown_artifact(summary, key=ARTIFACT_KEY, description="Nightly validation: tonight against the history")
    if comparisons:
        create_table_artifact(history.table_rows(comparisons), key=f"{ARTIFACT_KEY}-figures",
                              description="Nightly figures: tonight against the baseline of the trailing nights")


@flow(name="nightly-validation", on_cancellation=[_stop_subflow_clusters], on_crashed=[_stop_subflow_clusters])
def nightly_validation(
    sft: RunConfig = RunConfig.model_validate(NIGHTLY_SFT),
    rl: RunConfig = RunConfig.model_validate(NIGHTLY_RL),
    modes: list[Literal["sft", "rl"]] = ["sft", "rl"],  # noqa: B006 (a flow parameter default, never mutated)
    history_root: str | None = None,
) -> dict[str, dict]:
    """Run a short SFT job, then a short RL job; compare tonight with the nights before under `history_root`
    (any fsspec URL; default `<sft checkpoints>/nightly-history`); fail when a run fails or a figure regresses."""
    log = get_logger()
    started, began = history.now(), time.monotonic()
    results: dict[str, dict] = {}
    for name in modes:
        config = {"sft": sft, "rl": rl}[name]
        # Resolve here so the subflow's parameters carry the absolute state_dir (see the hooks).
        cfg = config.model_copy(update={"run_id": config.run_id or f"nightly-{new_run_id(config.mode)}"}).resolved()
        result = {"run_id": cfg.run_id, "status": "failed", "error": None, "report": None}
        try:
            report = train_flow.with_options(flow_run_name=cfg.run_id)(config=cfg)
            result.update(status=report.status, report=report)
        except RunFailed as failed:
            result.update(error=failed.report.error, report=failed.report)
        except Exception as exc:  # preflight or any other failure of the subflow
            result["error"] = "".join(traceback.format_exception_only(exc)).strip()
        log.info(f"nightly {name} run {cfg.run_id}: {result['status']}"
                 + (f" ({result['error']})" if result["error"] else ""))
        results[name] = result

    failed = {mode: r for mode, r in results.items() if r["status"] != "passed"}
    figures = {"nightly.total_s": time.monotonic() - began}
    for mode, r in results.items():
        if r["report"] is not None and mode not in failed:
            figures.update(figures_of_run(mode, r["report"]))
    record = history.NightlyRecord(started_at=started, finished_at=history.now(), versions=history.current_versions(),
                                   run_ids={m: r["run_id"] for m, r in results.items()}, figures=figures,
                                   status="failed" if failed else "passed")
    base = sft.resolved()
    root = history_root or f"{base.checkpoints.rstrip('/')}/{HISTORY_DIR}"
    options = base.plain_storage_options()
    records, problems = history.read(root, options)
    for problem in problems:
        log.warning(f"nightly history: {problem}")
    comparisons = history.compare(record, records)
    regressed = history.regression_message(comparisons)
    if regressed and not failed:
        record = record.model_copy(update={"status": "regression"})
    url = history.append(root, record, options)
    log.info(f"nightly history: record {url}; " + (regressed or "no regression against the trailing nights"))

    summary = history.markdown_summary(record, comparisons, problems)
    if failed:
        summary = summary.replace("# Nightly validation", "# Nightly validation **FAILED**", 1)
    _publish("\n".join([summary, *_runs_table(results)]), comparisons, [*records, record])
    reasons = [f"{mode} run {r['run_id']}: {r['error']}" for mode, r in failed.items()]
    if regressed:
        reasons.append(regressed)
    if reasons:
        raise NightlyValidationFailed("nightly validation FAILED: " + "; ".join(reasons))
    return {mode: {"run_id": r["run_id"], "status": r["status"]} for mode, r in results.items()}
