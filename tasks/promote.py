"""Step 9, promote (with `promote_as`, once every check passed and, with `approve`, a person approved):
the exported adapter published as `<checkpoints>/promoted/<name>/`, the previous promotion kept in
its history (`txflow.checkpoints.promotion` says how readers never see a mix)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.checkpoints import promotion
from txflow.checkpoints.export import ExportResult
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.reporting.history import current_versions
from txflow.results import RestoreCheck, Saved


def record(cfg: RunConfig, saved: Saved, restore: RestoreCheck, exported: ExportResult, metrics: list[dict],
           comment: str | None) -> dict:
    """promotion.json, but for what `promote` adds (name, id, time, files, previous)."""
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
            "versions": current_versions().model_dump(), "approval_comment": comment}


@task(name="promote", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def promote(cfg: RunConfig, saved: Saved, restore: RestoreCheck, exported: ExportResult, metrics: list[dict],
            comment: str | None = None) -> promotion.Promotion:
    parts = {part: url for part, url in (("peft", exported.peft_url), ("merged", exported.merged_url)) if url}
    result = promotion.promote(cfg.checkpoints, cfg.promote_as, cfg.run_id, parts,
                               record(cfg, saved, restore, exported, metrics, comment),
                               cfg.plain_storage_options(), workdir=cfg.state_dir)
    get_logger().info(f"promoted run {cfg.run_id} as {cfg.promote_as!r}: {result.url} (pointer {result.pointer})"
                      + (f"; removed {len(result.removed)} older promotions" if result.removed else ""))
    return result.model_copy(update={"comment": comment})
