"""Step 4, save-checkpoint: the final training state and sampler weights under
the run root, made durable and committed, plus the live model's reference
values that evaluate-restore must reproduce."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow import evaluation, skyrl_adapter, storage
from txflow.cluster import Cluster, Launcher
from txflow.config import RunConfig
from txflow.discovery import discover
from txflow.log import get_logger
from txflow.tinker_client import wait_result
from tasks.train import Trained

def eval_prompts(cfg: RunConfig, data) -> list[list[int]]:
    """Prompts whose greedy continuations compare the live and the restored model."""
    if cfg.mode == "rl":
        return data.prompts
    return [evaluation.prompt_of(e) for e in data.eval]


def save_client_checkpoints(cfg: RunConfig, cluster: Cluster) -> dict:
    """custom mode: the client saved what it wanted; commit every checkpoint it left in staging."""
    checkpoints = []
    for artifact in discover(cluster.checkpoints_base):
        path = skyrl_adapter.tinker_path_for(artifact.path)
        if artifact.kind in ("state", "sampler") and path and not skyrl_adapter.is_ephemeral_sampler(artifact.path):
            checkpoints.append({"kind": artifact.kind, "tinker_path": path,
                                "url": storage.commit(cfg, cluster.checkpoints_base, path)})
    if not checkpoints:
        raise FileNotFoundError(f"The custom client saved no checkpoint (nothing under {cluster.checkpoints_base})")
    return {"checkpoints": checkpoints, "live": None}


@task(name="save-checkpoint", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def save_checkpoint(cfg: RunConfig, cluster: Cluster, launcher: Launcher, trained: Trained, data) -> dict:
    """Save state and sampler weights, commit them to the run root, and record where they live."""
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

    name = storage.checkpoint_name(trained.metrics[-1]["step"] if trained.metrics else cfg.steps)
    state = wait_result(client.save_state(name), cluster, launcher, timeout, "save_state").path
    sampler = wait_result(client.save_weights_for_sampler(name), cluster, launcher, timeout,
                          "save_weights_for_sampler").path
    # The sampling clients of training wrote transient sampler weights next to the real ones.
    storage.remove_ephemeral_samplers(cluster.checkpoints_base)
    checkpoints = [{"kind": kind, "tinker_path": path, "url": storage.commit(cfg, cluster.checkpoints_base, path)}
                   for kind, path in (("state", state), ("sampler", sampler))]
    log.info("saved and committed " + "; ".join(f"{c['kind']} {c['tinker_path']} -> {c['url']}" for c in checkpoints))
    return {
        "checkpoints": checkpoints,
        "live": {"eval_loss": loss, "greedy_tokens": tokens, "prompts": prompts, "examples": examples},
    }
