"""Step 3, train: sft, rl or a custom client (`txflow.training.loop`)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.cluster.handle import ClusterHandle
from txflow.config import RunConfig
from txflow.results import Trained
from txflow.training import loop


# No task-level retries: a retry needs a fresh cluster, which the flow provisions (and the
# train step then resumes from the last durable state).
@task(name="train", retries=0, cache_policy=NO_CACHE)
def train(cfg: RunConfig, handle: ClusterHandle, data: Any, attempt: int = 1) -> Trained:
    """Run the training of `cfg.mode` against the cluster; `attempt` counts the runs of this step."""
    with handle.deaths_first():
        return loop.train(cfg, handle, data, attempt)
