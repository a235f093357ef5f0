"""Step 8, prune-checkpoints (with `keep_last`): once the run passed, its periodic state checkpoints
but the newest K go, each marker first (`txflow.checkpoints.retention`). The final state, the sampler,
the export and whatever a promotion was made from stay."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.checkpoints import promotion, retention
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.results import Discovered, Pruned


@task(name="prune-checkpoints", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def prune_checkpoints(cfg: RunConfig, discovered: Discovered) -> Pruned:
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
