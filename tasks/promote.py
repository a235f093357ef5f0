"""Step 9, promote (with `promote_as`, once every check passed and, with `approve`, a person approved):
the exported adapter published as `<checkpoints>/promoted/<name>/`, the previous promotion kept in
its history (`txflow.checkpoints.promotion` says how readers never see a mix; `txflow.artifacts.promote`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.artifacts import promote as promotions  # the step below is `promote`
from txflow.checkpoints.export import ExportResult
from txflow.checkpoints.promotion import Promotion
from txflow.config import RunConfig
from txflow.results import RestoreCheck, Saved


@task(name="promote", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def promote(cfg: RunConfig, saved: Saved, restore: RestoreCheck, exported: ExportResult, metrics: list[dict],
            comment: str | None = None) -> Promotion:
    """Publish the exported adapter under its name, with its figures in the promotion record."""
    return promotions.run(cfg, saved, restore, exported, metrics, comment)
