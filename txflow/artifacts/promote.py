"""promote and the sweep's `promote_best_as`: an export published under a name, with one record shape whoever
publishes it (a run's own step, or a sweep for its best member), and who approved it."""

from __future__ import annotations

from txflow.checkpoints import promotion
from txflow.checkpoints.export import ExportResult
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.reporting.history import current_versions
from txflow.results import Decision, RestoreCheck, Saved

UNKNOWN_APPROVER = "unknown (the Prefect server records no user)"


def approver(sender: str | None, named: str | None) -> str:
    """Who answered an approval, as the promotion record and the report name them: the sender Prefect stored
    with the answer, else the name the answer gives, else unknown.

    Prefect 3.9.1's own server knows no users: a resume through the UI or `resume_flow_run` stores the answer
    without a sender (`POST /flow_runs/{id}/resume`), the Running state it sets carries no author, and
    `pause_flow_run` returns the input with `metadata.sender` None. A sender is there only when whoever
    answered wrote the input with one (`create_flow_run_input(..., sender=...)`) before resuming. A name
    typed into the form is the approver's own word, and is recorded as such."""
    if sender:
        return f"{sender} (the sender Prefect stored with the answer)"
    if named and named.strip():
        return f"{named.strip()} (named in the approval form; the Prefect server records no user)"
    return UNKNOWN_APPROVER


def answer_sender(flow_run_id, key: str) -> str | None:
    """The sender Prefect stored with the flow run input `key` (the approval's answer), if any; None, with a
    warning, when the server cannot say (the answer stands: who gave it is a record, not a condition)."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            found = client.filter_flow_run_input(flow_run_id=flow_run_id, key_prefix=key, limit=10,
                                                 exclude_keys=set())
    except Exception as exc:  # the server briefly away: the approval is not undone for its record
        get_logger().warning(f"could not read who answered the approval ({type(exc).__name__}: {exc})")
        return None
    return next((i.sender for i in found if i.key == key and i.sender), None)


def record(mode: str, run_root: str, exported: ExportResult, figures: dict, state_url: str | None,
           decision: Decision | None = None, sweep: dict | None = None) -> dict:
    """promotion.json, but for what `promotion.promote` adds (name, id, time, files, previous): the same fields
    whoever promotes; `sweep` says how a sweep chose the run."""
    figures = {**figures, "export_max_abs_logprob_diff": exported.max_abs_logprob_diff,
               "export_greedy_tokens_match": exported.greedy_tokens_match}
    return {"mode": mode, "base_model": exported.base_model, "run_root": run_root, "figures": figures,
            "sources": {"state": state_url, "sampler": exported.sampler_url, "peft": exported.peft_url,
                        "merged": exported.merged_url},
            "adapter": {"r": exported.r, "lora_alpha": exported.lora_alpha, "target_modules": exported.target_modules},
            "versions": current_versions().model_dump(),
            "approval_comment": decision.comment if decision else None,
            "approver": decision.approver if decision else None,
            "sweep": sweep}


def _figures(metrics: list[dict], quality: dict) -> dict:
    """A promotion's figures: the step count, the last step's figures and the quality check's."""
    last = {k: v for k, v in (metrics[-1] if metrics else {}).items() if k != "step"}
    return {"steps": len(metrics), **last, **quality}


def _parts(exported: ExportResult) -> dict[str, str]:
    return {part: url for part, url in (("peft", exported.peft_url), ("merged", exported.merged_url)) if url}


def run(cfg: RunConfig, saved: Saved, restore: RestoreCheck, exported: ExportResult, metrics: list[dict],
        decision: Decision | None = None) -> promotion.Promotion:
    """Publish the exported adapter as `<checkpoints>/promoted/<promote_as>/`, its figures (and, with `approve`,
    the approval's comment and approver) in the record."""
    state = next((c.url for c in reversed(saved.checkpoints) if c.kind == "state"), None)
    figures = _figures(metrics, restore.quality)
    if restore.abs_diff is not None:
        figures["restore_abs_diff"] = restore.abs_diff
    result = promotion.promote(cfg.checkpoints, cfg.export.promote_as, cfg.run_id, _parts(exported),
                               record(cfg.mode, cfg.run_root, exported, figures, state, decision),
                               cfg.plain_storage_options(), workdir=cfg.state_dir)
    get_logger().info(f"promoted run {cfg.run_id} as {cfg.export.promote_as!r}: {result.url} (pointer {result.pointer})"
                      + (f"; removed {len(result.removed)} older promotions" if result.removed else ""))
    return result.model_copy(update={"comment": decision.comment if decision else None,
                                     "approver": decision.approver if decision else None})


def best(config: RunConfig, ranking: dict, reports: dict, name: str) -> dict | None:
    """Publish the exported adapter of a sweep's best member that passed (`ranking["best"]`, its report in
    `reports`) as promotion `name`; None when none did."""
    best_id = ranking["best"]
    report = reports.get(best_id) if best_id else None
    if report is None or report.export is None:
        return None
    figures = _figures(report.metrics, {k: v for k, v in (report.restore or {}).items() if isinstance(v, int | float)})
    state = ((report.checkpoints or {}).get("state") or {}).get("url")
    chosen = {"ranked_by": ranking["ranked_by"], "members": len(ranking["members"])}
    promoted = promotion.promote(config.checkpoints, name, best_id, _parts(report.export),
                                 record(report.mode, report.checkpoint_root, report.export, figures, state,
                                        sweep=chosen), config.plain_storage_options())
    return {"name": name, "run_id": best_id, "url": promoted.url}
