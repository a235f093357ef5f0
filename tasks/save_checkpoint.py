"""Step 4, save-checkpoint: the final training state and sampler weights under
the run root, made durable and committed, plus the live model's reference
values that evaluate-restore must reproduce."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow import evaluation, skyrl_adapter
from txflow.cluster import Cluster, Launcher
from txflow.config import RunConfig
from txflow.discovery import discover
from txflow.log import get_logger
from txflow.storage import checkpoint_urls, commit_checkpoints, remove_ephemeral_samplers
from txflow.tinker_client import wait_result
from tasks.train import Trained

FINAL = "final"


def eval_prompts(cfg: RunConfig, data) -> list[list[int]]:
    """Prompts whose greedy continuations compare the live and the restored model."""
    if cfg.mode == "rl":
        return data.prompts
    return [evaluation.prompt_of(e) for e in data.eval]


def save_client_checkpoints(cfg: RunConfig, cluster: Cluster) -> dict:
    """custom mode: the client saved what it wanted; find every checkpoint under the run root and commit it."""
    checkpoints = []
    for artifact in discover(cluster.checkpoints_base):
        path = skyrl_adapter.tinker_path_for(artifact.path)
        if artifact.kind in ("state", "sampler") and path and not skyrl_adapter.is_ephemeral_sampler(artifact.path):
            checkpoints.append({"kind": artifact.kind, "tinker_path": path,
                                "url": f"{cfg.run_root}/{artifact.path}"})
    if not checkpoints:
        raise FileNotFoundError(f"The custom client saved no checkpoint under {cfg.run_root}")
    commit_checkpoints(cfg, cluster, [c["url"] for c in checkpoints])
    return {"checkpoints": checkpoints, "live": None}


@task(name="save-checkpoint", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def save_checkpoint(cfg: RunConfig, cluster: Cluster, launcher: Launcher, trained: Trained, data) -> dict:
    """Save state and sampler weights, make them durable, and record where they live."""
    log = get_logger()
    if cfg.mode == "custom":
        return save_client_checkpoints(cfg, cluster)
    client = trained.training_client
    timeout = cfg.step_timeout_s
    # Reference values of the live model, taken before anything is written.
    prompts = eval_prompts(cfg, data)
    live_sampler = client.save_weights_and_get_sampling_client()
    tokens = evaluation.greedy_tokens(live_sampler, prompts, cluster, launcher, timeout, cfg.seed)
    examples = data.eval if cfg.mode == "sft" else evaluation.rollout_examples(prompts, tokens)
    loss = evaluation.eval_loss(client, examples, cluster, launcher, timeout)

    state = wait_result(client.save_state(FINAL), cluster, launcher, timeout, "save_state").path
    sampler = wait_result(client.save_weights_for_sampler(FINAL), cluster, launcher, timeout,
                          "save_weights_for_sampler").path
    # The sampling clients of training wrote transient sampler weights next to the real ones.
    remove_ephemeral_samplers(cluster.checkpoints_base)
    urls = checkpoint_urls(cfg, state, sampler)
    commit_checkpoints(cfg, cluster, list(urls.values()))
    log.info(f"saved state {state} -> {urls['state']}; sampler {sampler} -> {urls['sampler']}")
    return {
        "checkpoints": [{"kind": "state", "tinker_path": state, "url": urls["state"]},
                        {"kind": "sampler", "tinker_path": sampler, "url": urls["sampler"]}],
        "live": {"eval_loss": loss, "greedy_tokens": tokens, "prompts": prompts, "examples": examples},
    }
