"""Step 1, provision-coordinator: the Tinker API server and rank 0 (the engine, which hosts the JAX
coordinator), started by `txflow.cluster.startup.provision`."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.cluster import named, startup
from txflow.cluster.handle import ClusterHandle
from txflow.cluster.launcher import Launcher, PlacementFailed
from txflow.cluster.monitor import retry_unless
from txflow.config import RunConfig


# Retries are safe here: a failed attempt stops what it started, and the next one starts afresh (a
# port taken meanwhile, say). A cluster that cannot be placed is not retried: it would not fit now either.
@task(name="provision-coordinator", retries=1, retry_delay_seconds=2,
      retry_condition_fn=retry_unless(PlacementFailed, named.AttachFailed), cache_policy=NO_CACHE)
def provision_coordinator(cfg: RunConfig, launcher: Launcher, base_model_path: str) -> ClusterHandle:
    """Start the API server, then rank 0 on `base_model_path` (pre-flight's), without waiting for either
    (launch-workers proves them ready); with `cluster` set, attach to that shared cluster instead."""
    if cfg.cluster:
        return named.attach(cfg, base_model_path)
    return startup.provision(cfg, launcher, base_model_path)
