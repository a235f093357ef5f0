"""Step 0, preflight: every input checked before any process starts (`txflow.preflight`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.config import RunConfig
from txflow.preflight import prepare


@task(name="preflight", retries=0, cache_policy=NO_CACHE)
def preflight(cfg: RunConfig):
    """Validate everything the run needs; returns the prepared data of its mode. Bad input raises
    `PreflightError` with a sentence that says what to change."""
    return prepare(cfg)
