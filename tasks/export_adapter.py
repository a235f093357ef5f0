"""Step 7, export-adapter: the trained adapter as a Hugging Face PEFT adapter (and, on request, the merged
model) under `<run_root>/export/`, proven to reproduce SkyRL-tx's restored sampler
(`txflow.artifacts.export`). It runs after teardown: it needs the durable sampler checkpoint and the
figures evaluate-restore recorded, not the cluster, so no process waits on it."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.artifacts import export
from txflow.config import RunConfig
from txflow.results import Exported, RestoreCheck


@task(name="export-adapter", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def export_adapter(cfg: RunConfig, restore: RestoreCheck) -> Exported:
    """Export the sampler checkpoint evaluate-restore checked, prove it outside SkyRL, commit it, and list
    the run root again (the manifest then names the export too)."""
    return export.run(cfg, restore)
