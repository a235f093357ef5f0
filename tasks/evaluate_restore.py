"""Step 6, evaluate-restore: the saved checkpoints reproduce the live model, and
the run reached the quality bar of its mode."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow import evaluation
from txflow.cluster import Cluster, Launcher
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.tinker_client import service_client

LOSS_TOLERANCE = 1e-6


@task(name="evaluate-restore", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def evaluate_restore(cfg: RunConfig, cluster: Cluster, launcher: Launcher, metrics: list[dict], saved: dict,
                     eval_examples) -> dict:
    """Restore the state into a fresh training client and sample from the saved sampler weights."""
    log = get_logger()
    client = service_client(cluster)
    timeout = cfg.step_timeout_s
    restored = client.create_training_client_from_state(saved["state"]["tinker_path"])
    try:
        loss_after = evaluation.eval_loss(restored, eval_examples, cluster, launcher, timeout)
    finally:
        evaluation.unload(cluster, restored.model_id)
    sampler = client.create_sampling_client(model_path=saved["sampler"]["tinker_path"])
    tokens = evaluation.greedy_tokens(sampler, saved["live"]["prompts"], cluster, launcher, timeout, cfg.seed)

    loss_before = saved["live"]["eval_loss"]
    abs_diff = abs(loss_after - loss_before)
    tokens_match = tokens == saved["live"]["greedy_tokens"]
    first, last = metrics[0]["nll"], metrics[-1]["nll"]
    result = {
        "loss_before": loss_before,
        "loss_after": loss_after,
        "abs_diff": abs_diff,
        "sampler_tokens_match": tokens_match,
        "live_tokens": saved["live"]["greedy_tokens"],
        "restored_tokens": tokens,
        "first_step_loss": first,
        "final_step_loss": last,
        "loss_fell": last < first,
    }
    result["passed"] = abs_diff <= LOSS_TOLERANCE and tokens_match and result["loss_fell"]
    log.info(f"restore check: loss {loss_before:.6f} -> {loss_after:.6f} (|diff| {abs_diff:.2e}), "
             f"greedy tokens match {tokens_match}, training loss {first:.4f} -> {last:.4f}: "
             f"{'PASSED' if result['passed'] else 'FAILED'}")
    return result
