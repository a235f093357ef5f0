"""Step 0, preflight: every input checked before any process starts (`txflow.preflight`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.config import RunConfig
from txflow.preflight import Checked, prepare


@task(name="preflight", retries=0, cache_policy=NO_CACHE)
def preflight(cfg: RunConfig, checked: Checked | None = None) -> Checked:
    """Validate everything the run needs; returns its base model's path and the prepared data of its mode.
    Bad input raises `PreflightError` with a sentence that says what to change. `checked`: what `txflow run`
    found for this config a moment ago, before it started Prefect; taken as it is."""
    return checked if checked is not None else prepare(cfg)
