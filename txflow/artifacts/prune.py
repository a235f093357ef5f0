"""prune-checkpoints and `txflow prune`: delete the periodic states retention lets go; what a promotion was made
from stays, whoever prunes."""

from __future__ import annotations

from txflow.checkpoints import promotion, retention
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.results import Discovered, Pruned


def run(cfg: RunConfig, discovered: Discovered) -> Pruned:
    """Delete what `keep_last` lets go in this run's root, then list it again (the manifest loses what went)."""
    log = get_logger()
    options = cfg.plain_storage_options()
    protected = promotion.sources(cfg.checkpoints, options)
    deletions = retention.apply(cfg.run_root, discovered.artifacts, cfg.export.keep_last, options, protected)
    for deletion in deletions:
        log.info(f"pruned {deletion.url} ({deletion.bytes} bytes): {deletion.reason}")
    freed = sum(d.bytes for d in deletions)
    log.info(f"prune-checkpoints: kept the newest {cfg.export.keep_last} periodic states; {len(deletions)} deleted, "
             f"{freed} bytes freed")
    return Pruned(keep_last=cfg.export.keep_last, deletions=deletions, bytes_freed=freed,
                  discovered=Discovered.list_run_root(cfg.run_root, options))


def root(checkpoints: str, keep_last: int | None, older_than: float | None, options: dict, dry_run: bool = False,
         include_failed: bool = False) -> tuple[list[retention.RunPrune], list[str]]:
    """Every run under a checkpoints root pruned (or, dry, planned), and the promotions the pointer moved past
    that a promotion's own trim failed to delete: (runs, promotions removed). ValueError before anything is
    deleted on bad input."""
    protected = promotion.sources(checkpoints, options)
    runs = retention.prune(checkpoints, keep_last, older_than, dry_run=dry_run, include_failed=include_failed,
                           protected=protected, storage_options=options)
    return runs, [] if dry_run else promotion.trim_all(checkpoints, options)
