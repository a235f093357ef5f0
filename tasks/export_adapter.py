"""Step 7, export-adapter: the trained adapter as a Hugging Face PEFT adapter (and, on request, the merged
model) under `<run_root>/export/`, proven to reproduce SkyRL-tx's restored sampler. It runs after
teardown: it needs the durable sampler checkpoint and the figures evaluate-restore recorded, not the
cluster, so no process waits on it."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.checkpoints import export
from txflow.config import TINY_MODEL, RunConfig
from txflow.log import get_logger
from txflow.results import Discovered, Exported, RestoreCheck


def run_card(cfg: RunConfig, restore: RestoreCheck) -> dict:
    """What the exported model card says of the run."""
    return {"run_id": cfg.run_id, "mode": cfg.mode, "steps": cfg.steps, "base_model": cfg.base_model,
            "base_model_source": "tiny" if cfg.base_model == TINY_MODEL else "user",
            "dataset": cfg.dataset or f"txflow's bundled {cfg.mode} dataset", "quality": restore.quality}


@task(name="export-adapter", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def export_adapter(cfg: RunConfig, restore: RestoreCheck) -> Exported:
    """Export the sampler checkpoint evaluate-restore checked, prove it outside SkyRL, commit it, and list
    the run root again (the manifest then names the export too)."""
    log = get_logger()
    options = cfg.plain_storage_options()
    reference = restore.reference
    if reference is None:
        raise RuntimeError("evaluate-restore recorded no reference figures, so no export can be proven")
    result = export.export(reference, f"{cfg.run_root}/{export.EXPORT_DIR}", options, reference.base_model,
                           run_card(cfg, restore), merged=cfg.export_merged, keep_others=True, log=log.info)
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
