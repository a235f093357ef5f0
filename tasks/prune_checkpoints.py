"""Step 8, prune-checkpoints (with `keep_last`): once the run passed, its periodic state checkpoints
but the newest K go, each marker first (`txflow.checkpoints.retention`). The final state, the sampler,
the export and whatever a promotion was made from stay (`txflow.artifacts.prune`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.artifacts import prune
from txflow.config import RunConfig
from txflow.results import Discovered, Pruned


@task(name="prune-checkpoints", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def prune_checkpoints(cfg: RunConfig, discovered: Discovered) -> Pruned:
    """Delete what `keep_last` lets go, then list the run root again (the manifest loses what went)."""
    return prune.run(cfg, discovered)
