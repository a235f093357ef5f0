"""The `nightly-validation` flow: a short SFT run and a short RL run of `train`
as subflows; it fails (loudly: Failed state, the failures in its message and
in a markdown artifact) when either run fails or misses its checks.

Deployed as `nightly-validation/nightly` from prefect.yaml with a cron schedule.
"""

from __future__ import annotations

import traceback

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from deployments.defaults import NIGHTLY_RL, NIGHTLY_SFT
from flows.train import RunFailed, train_flow
from txflow.launchers import stop_cluster
from txflow.config import RunConfig, new_run_id
from txflow.log import get_logger


class NightlyValidationFailed(RuntimeError):
    """At least one of the nightly runs failed; the message says which and why."""


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
                     + (", ".join(f"{r.role} pid {r.pid} exit {r.exit_code}" for r in records) or "nothing recorded"))


def _summary(results: dict[str, dict]) -> str:
    lines = ["# Nightly validation: " + ("passed" if all(r["status"] == "passed" for r in results.values())
                                         else "**FAILED**"), "", "| run | run id | status | error |",
             "|---|---|---|---|"]
    for mode, r in results.items():
        error = (r["error"] or "").replace("|", "\\|").replace("\n", " ")[-300:]
        lines.append(f"| {mode} | `{r['run_id']}` | {r['status']} | {error} |")
    return "\n".join(lines)


@flow(name="nightly-validation", on_cancellation=[_stop_subflow_clusters], on_crashed=[_stop_subflow_clusters])
def nightly_validation(
    sft: RunConfig = RunConfig.model_validate(NIGHTLY_SFT),
    rl: RunConfig = RunConfig.model_validate(NIGHTLY_RL),
) -> dict[str, dict]:
    """Run a short SFT job, then a short RL job; fail when either fails or misses its checks."""
    log = get_logger()
    results: dict[str, dict] = {}
    for name, config in (("sft", sft), ("rl", rl)):
        # Resolve here so the subflow's parameters carry the absolute state_dir (see the hooks).
        cfg = config.model_copy(update={"run_id": config.run_id or f"nightly-{new_run_id(config.mode)}"}).resolved()
        result = {"run_id": cfg.run_id, "status": "failed", "error": None, "report": None}
        try:
            report = train_flow.with_options(flow_run_name=cfg.run_id)(config=cfg)
            result.update(status=report["status"], report=report)
        except RunFailed as failed:
            result.update(error=failed.report["error"] or "restore check failed", report=failed.report)
        except Exception as exc:  # preflight or any other failure of the subflow
            result["error"] = "".join(traceback.format_exception_only(exc)).strip()
        log.info(f"nightly {name} run {cfg.run_id}: {result['status']}"
                 + (f" ({result['error']})" if result["error"] else ""))
        results[name] = result
    create_markdown_artifact(_summary(results), key="nightly-validation", description="Nightly validation result")
    failed = {mode: r for mode, r in results.items() if r["status"] != "passed"}
    if failed:
        raise NightlyValidationFailed(
            "nightly validation FAILED: "
            + "; ".join(f"{mode} run {r['run_id']}: {r['error']}" for mode, r in failed.items())
        )
    return {mode: {"run_id": r["run_id"], "status": r["status"]} for mode, r in results.items()}
