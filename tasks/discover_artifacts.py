"""Step 5, discover-artifacts: what the run really left in durable storage (`txflow.artifacts.discover`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.artifacts import discover
from txflow.config import RunConfig
from txflow.results import Discovered, Saved


@task(name="discover-artifacts", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def discover_artifacts(cfg: RunConfig, saved: Saved) -> Discovered:
    """List and check every artifact under the run root, write manifest.json, and fail when a checkpoint
    this run saved is missing, incomplete or uncommitted."""
    return discover.run(cfg, saved)
