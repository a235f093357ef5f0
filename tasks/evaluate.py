"""Step 7, evaluate (with `eval_task`): a real harness scores the base model and the trained adapter on a task,
through txflow's OpenAI-compatible endpoint over the run's own cluster (`txflow.serving.evaluation`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.cluster.handle import ClusterHandle
from txflow.cluster.monitor import retry_unless_cluster_fault
from txflow.config import RunConfig
from txflow.results import Saved
from txflow.serving import evaluation


@task(name="evaluate", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_cluster_fault,
      cache_policy=NO_CACHE)
def evaluate(cfg: RunConfig, handle: ClusterHandle, saved: Saved) -> dict:
    """Inspect's scores of the base model and of the run's checked sampler on `cfg.eval_task`, side by side."""
    return evaluation.evaluate_run(cfg, handle, saved)
