"""Step 4, save-checkpoint: the final training state and sampler weights under
the run root, plus the live model's reference values for evaluate-restore."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow import evaluation
from txflow.cluster import Cluster, Launcher
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.storage import checkpoint_urls, commit_checkpoints
from txflow.tinker_client import wait_result
from tasks.train import Trained

FINAL = "final"


@task(name="save-checkpoint", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def save_checkpoint(cfg: RunConfig, cluster: Cluster, launcher: Launcher, trained: Trained, eval_examples) -> dict:
    """Save state and sampler weights, make them durable, and record where they live."""
    log = get_logger()
    client = trained.training_client
    timeout = cfg.step_timeout_s
    # Reference values of the live model, taken before anything is written.
    loss = evaluation.eval_loss(client, eval_examples, cluster, launcher, timeout)
    live_sampler = client.save_weights_and_get_sampling_client()
    prompts = [evaluation.prompt_of(e) for e in eval_examples]
    tokens = evaluation.greedy_tokens(live_sampler, prompts, cluster, launcher, timeout, cfg.seed)

    state = wait_result(client.save_state(FINAL), cluster, launcher, timeout, "save_state").path
    sampler = wait_result(client.save_weights_for_sampler(FINAL), cluster, launcher, timeout,
                          "save_weights_for_sampler").path
    urls = checkpoint_urls(cfg, state, sampler)
    commit_checkpoints(cfg, cluster, urls)
    log.info(f"saved state {state} -> {urls['state']}; sampler {sampler} -> {urls['sampler']}")
    return {
        "state": {"tinker_path": state, "url": urls["state"]},
        "sampler": {"tinker_path": sampler, "url": urls["sampler"]},
        "live": {"eval_loss": loss, "greedy_tokens": tokens, "prompts": prompts},
    }
