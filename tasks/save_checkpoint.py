"""Step 4, save-checkpoint: the final state and the sampler weights, durable and committed
(`txflow.training.saving`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.cluster.handle import ClusterHandle
from txflow.cluster.monitor import retry_unless_cluster_fault
from txflow.config import RunConfig
from txflow.results import Saved, Trained
from txflow.training import saving


@task(name="save-checkpoint", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_cluster_fault,
      cache_policy=NO_CACHE)
def save_checkpoint(cfg: RunConfig, handle: ClusterHandle, trained: Trained) -> Saved:
    """Save the sampler weights, commit them to the run root, and record where everything lives."""
    with handle.deaths_first():
        return saving.save(cfg, handle, trained)
