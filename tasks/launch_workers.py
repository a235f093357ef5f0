"""Step 2, launch-workers: ranks 1..N-1 once rank 0's process exists, then a readiness request that every
rank takes part in (`txflow.cluster.startup.launch_workers`): the base model's greedy answers to the run's held-out
prompts, which the live reference at the last step takes instead of sampling them again (`base_figures.offer`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.cluster import named, startup
from txflow.cluster.handle import ClusterHandle
from txflow.config import RunConfig
from txflow.training import base_figures, evaluation


@task(name="launch-workers", retries=0, cache_policy=NO_CACHE)
def launch_workers(cfg: RunConfig, handle: ClusterHandle, prompts: list[list[int]] | None = None) -> ClusterHandle:
    """Start every rank > 0 now that rank 0's process exists, then prove the whole cluster serves a request: the
    base model's greedy answers to `prompts` (the run's held-out prompts) when they fit one sampling batch, kept
    for the live reference; attached to a shared cluster, check that it serves and has a free adapter slot."""
    with handle.deaths_first():
        if handle.shared is not None:
            return named.verify(cfg, handle)
        tokens = startup.launch_workers(cfg, handle, prompts, cfg.seed)
        if tokens is not None:
            base_figures.offer(handle, evaluation.BASE_GREEDY, evaluation.base_greedy_inputs(prompts, cfg.seed),
                               tokens)
        return handle
