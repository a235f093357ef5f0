"""What a run left in durable storage and what becomes of it: discover-artifacts (every artifact listed and
checked, the manifest written), export-adapter (the proven PEFT export of the checked sampler),
prune-checkpoints (`keep_last`), who answered the approval (`approve`) and promote (`promote_as`). The steps in
`tasks/` wrap these."""

from __future__ import annotations

import threading

from txflow.checkpoints import export, promotion, retention
from txflow.checkpoints.export import ExportResult
from txflow.config import TINY_MODEL, RunConfig
from txflow.export import writer
from txflow.log import get_logger, scrub
from txflow.reporting.history import current_versions
from txflow.results import Decision, Discovered, Exported, Pruned, RestoreCheck, Saved


def discover(cfg: RunConfig, saved: Saved) -> Discovered:
    """List and check every artifact under the run root, write manifest.json, and fail when a checkpoint
    this run saved is missing, incomplete or uncommitted."""
    log = get_logger()
    discovered = Discovered.list_run_root(cfg.run_root, cfg.plain_storage_options())
    by_url = {a.url: a for a in discovered.artifacts}
    for ckpt in saved.checkpoints:
        found = by_url.get(ckpt.url)
        if found is None:
            raise FileNotFoundError(f"The {ckpt.kind} checkpoint this run saved is not in storage at {ckpt.url}")
        if not (found.complete and found.committed):
            raise RuntimeError(f"The {ckpt.kind} checkpoint at {ckpt.url} is not usable: "
                               f"{found.reason or 'not committed'}")
    for a in discovered.artifacts:
        log.info(f"{a.kind:8} {a.format:9} {'ok' if a.complete else 'INCOMPLETE'} {a.bytes:>10} B "
                 f"{a.files if a.files is not None else '-':>4} files {a.url}" + (f" ({a.reason})" if a.reason else ""))
    return discovered


def run_card(cfg: RunConfig, restore: RestoreCheck) -> dict:
    """What the exported model card says of the run."""
    return {"run_id": cfg.run_id, "mode": cfg.mode, "steps": cfg.steps, "base_model": cfg.base_model,
            "base_model_source": "tiny" if cfg.base_model == TINY_MODEL else "user",
            "dataset": scrub(cfg.dataset) if cfg.dataset else f"txflow's bundled {cfg.mode} dataset",
            "quality": restore.quality}


# One export at a time in a process (a sweep's members run in threads of one): transformers sets torch's
# process-wide default dtype while it builds a model, so a bf16 load in one thread made another's float32
# proof compute in bf16 (max |Δ logprob| 1.26) or fail ("unsupported scalarType"). Two exports on 2 cores
# would only share them anyway.
_ONE_EXPORT_AT_A_TIME = threading.Lock()


def export_run(cfg: RunConfig, restore: RestoreCheck) -> Exported:
    """Export the sampler checkpoint evaluate-restore checked, prove it outside SkyRL, commit it, and list
    the run root again (the manifest then names the export too)."""
    log = get_logger()
    options = cfg.plain_storage_options()
    reference = restore.reference
    if reference is None:
        raise RuntimeError("evaluate-restore recorded no reference figures, so no export can be proven")
    with _ONE_EXPORT_AT_A_TIME:
        result = writer.export(reference, f"{cfg.run_root}/{export.EXPORT_DIR}", options, reference.base_model,
                               run_card(cfg, restore), merged=cfg.export_merged, keep_others=True, log=log.info,
                               signed_as=f"{cfg.run_id}/{export.EXPORT_DIR}")
    discovered = Discovered.list_run_root(cfg.run_root, options)
    if result.passed:
        found = {a.url: a for a in discovered.artifacts}
        for url in filter(None, (result.peft_url, result.merged_url)):
            listed = found.get(url)
            if listed is None or listed.kind != "export" or not (listed.complete and listed.committed):
                raise RuntimeError(f"The export at {url} is not listed as a complete, committed export: "
                                   f"{listed.reason if listed else 'not found'}")
        log.info(f"exported {result.peft_url}" + (f" and {result.merged_url}" if result.merged_url else "")
                 + f" in {result.seconds:.1f} s")
    else:
        log.error(f"export check FAILED: {export.failure(result)}")
    return Exported(result=result, discovered=discovered)


def prune_run(cfg: RunConfig, discovered: Discovered) -> Pruned:
    """Delete what `keep_last` lets go, then list the run root again (the manifest loses what went)."""
    log = get_logger()
    options = cfg.plain_storage_options()
    protected = promotion.sources(cfg.checkpoints, options)
    deletions = retention.apply(cfg.run_root, discovered.artifacts, cfg.keep_last, options, protected)
    for deletion in deletions:
        log.info(f"pruned {deletion.url} ({deletion.bytes} bytes): {deletion.reason}")
    freed = sum(d.bytes for d in deletions)
    log.info(f"prune-checkpoints: kept the newest {cfg.keep_last} periodic states; {len(deletions)} deleted, "
             f"{freed} bytes freed")
    return Pruned(keep_last=cfg.keep_last, deletions=deletions, bytes_freed=freed,
                  discovered=Discovered.list_run_root(cfg.run_root, options))


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


def promotion_record(cfg: RunConfig, saved: Saved, restore: RestoreCheck, exported: ExportResult,
                     metrics: list[dict], decision: Decision | None) -> dict:
    """promotion.json, but for what `promotion.promote` adds (name, id, time, files, previous)."""
    state = next((c.url for c in reversed(saved.checkpoints) if c.kind == "state"), None)
    figures = {"steps": len(metrics), **{k: v for k, v in (metrics[-1] if metrics else {}).items() if k != "step"},
               **restore.quality, "export_max_abs_logprob_diff": exported.max_abs_logprob_diff,
               "export_greedy_tokens_match": exported.greedy_tokens_match}
    if restore.abs_diff is not None:
        figures["restore_abs_diff"] = restore.abs_diff
    return {"mode": cfg.mode, "base_model": exported.base_model, "run_root": cfg.run_root, "figures": figures,
            "sources": {"state": state, "sampler": exported.sampler_url, "peft": exported.peft_url,
                        "merged": exported.merged_url},
            "adapter": {"r": exported.r, "lora_alpha": exported.lora_alpha, "target_modules": exported.target_modules},
            "versions": current_versions().model_dump(),
            "approval_comment": decision.comment if decision else None,
            "approver": decision.approver if decision else None}


def promote_run(cfg: RunConfig, saved: Saved, restore: RestoreCheck, exported: ExportResult, metrics: list[dict],
                decision: Decision | None = None) -> promotion.Promotion:
    """Publish the exported adapter as `<checkpoints>/promoted/<promote_as>/`, its figures (and, with `approve`,
    the approval's comment and approver) in the record."""
    parts = {part: url for part, url in (("peft", exported.peft_url), ("merged", exported.merged_url)) if url}
    result = promotion.promote(cfg.checkpoints, cfg.promote_as, cfg.run_id, parts,
                               promotion_record(cfg, saved, restore, exported, metrics, decision),
                               cfg.plain_storage_options(), workdir=cfg.state_dir)
    get_logger().info(f"promoted run {cfg.run_id} as {cfg.promote_as!r}: {result.url} (pointer {result.pointer})"
                      + (f"; removed {len(result.removed)} older promotions" if result.removed else ""))
    return result.model_copy(update={"comment": decision.comment if decision else None,
                                     "approver": decision.approver if decision else None})
