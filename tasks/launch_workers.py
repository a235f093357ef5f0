"""Step 2, launch-workers: ranks 1..N-1 once rank 0's process exists, then a readiness request that every
rank takes part in (`txflow.cluster.startup.launch_workers`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.cluster import named, startup
from txflow.cluster.handle import ClusterHandle
from txflow.config import RunConfig


@task(name="launch-workers", retries=0, cache_policy=NO_CACHE)
def launch_workers(cfg: RunConfig, handle: ClusterHandle) -> ClusterHandle:
    """Start every rank > 0 now that rank 0's process exists, then prove the whole cluster serves a request;
    attached to a shared cluster, check that it serves and has a free adapter slot."""
    with handle.deaths_first():
        if handle.shared is not None:
            return named.verify(cfg, handle)
        return startup.launch_workers(cfg, handle)
