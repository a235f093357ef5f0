"""Step 4, save-checkpoint: the final training state (committed by the train
step at its last step) and the sampler weights under the run root, made
durable and committed, plus the live model's reference values that
evaluate-restore must reproduce."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.checkpoints import storage
from txflow.checkpoints.discovery import discover
from txflow.cluster.handle import ClusterHandle
from txflow.cluster.monitor import retry_unless_cluster_fault
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.results import Checkpoint, LiveReference, Saved, Trained
from txflow.training import evaluation
from txflow.training.clients import training_client_at
from txflow.upstream.skyrl_tx import layout


def eval_prompts(cfg: RunConfig, data) -> list[list[int]]:
    """Prompts whose greedy continuations compare the live and the restored model."""
    if cfg.mode == "rl":
        return data.prompts
    return [evaluation.prompt_of(e) for e in data.eval]


def save_client_checkpoints(cfg: RunConfig, handle: ClusterHandle) -> Saved:
    """custom mode: the client saved what it wanted; commit every checkpoint it left in staging."""
    checkpoints = []
    base = handle.cluster.checkpoints_base
    for artifact in discover(base):
        path = layout.tinker_path_for(artifact.path)
        if artifact.kind in ("state", "sampler") and path and not layout.is_ephemeral_sampler(artifact.path):
            checkpoints.append(Checkpoint(kind=artifact.kind, tinker_path=path, url=storage.commit(cfg, base, path),
                                          saved_at=(Path(base) / artifact.path).stat().st_mtime))
    if not checkpoints:
        raise FileNotFoundError(f"The custom client saved no checkpoint (nothing under {base})")
    return Saved(checkpoints=checkpoints)


def live_client(cfg: RunConfig, handle: ClusterHandle, trained: Trained):
    """The trained model on `handle`: the live client, or, when training ran on a cluster that has
    since failed, a fresh client holding the committed final state (weights and optimizer)."""
    if trained.handle is handle:
        return trained.training_client, False
    step = storage.step_of(trained.final_state.url)
    get_logger().info(f"save-checkpoint resumes on a fresh cluster from the committed final state of step {step} "
                      f"({trained.final_state.url}); training does not run again")
    return training_client_at(cfg, handle, (trained.final_state.url, step)), True


@task(name="save-checkpoint", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_cluster_fault,
      cache_policy=NO_CACHE)
def save_checkpoint(cfg: RunConfig, handle: ClusterHandle, trained: Trained, data) -> Saved:
    """Save the sampler weights, commit them to the run root, and record where everything lives."""
    with handle.deaths_first():
        if cfg.mode == "custom":
            return save_client_checkpoints(cfg, handle)
        return save_model_checkpoints(cfg, handle, trained, data)


def save_model_checkpoints(cfg: RunConfig, handle: ClusterHandle, trained: Trained, data) -> Saved:
    log = get_logger()
    client, from_committed = live_client(cfg, handle, trained)
    timeout = cfg.step_timeout_s
    # Reference values of the live model, taken before the sampler weights are written.
    prompts = eval_prompts(cfg, data)
    live_sampler = client.save_weights_and_get_sampling_client()
    tokens = evaluation.greedy_tokens(live_sampler, prompts, handle, timeout, cfg.seed)
    base_sampler = handle.service_client().create_sampling_client(base_model=handle.cluster.base_model_path)
    base_tokens = evaluation.greedy_tokens(base_sampler, prompts, handle, timeout, cfg.seed)
    examples = data.eval if cfg.mode == "sft" else evaluation.rollout_examples(prompts, tokens)
    loss = evaluation.eval_loss(client, examples, handle, timeout)

    name = storage.checkpoint_name(storage.step_of(trained.final_state.url))
    sampler_path = handle.wait(client.save_weights_for_sampler(name), "save_weights_for_sampler", timeout).path
    # The sampling clients of training wrote transient sampler weights next to the real ones.
    storage.remove_ephemeral_samplers(handle.cluster.checkpoints_base)
    sampler = Checkpoint(kind="sampler", tinker_path=sampler_path,
                         url=storage.commit(cfg, handle.cluster.checkpoints_base, sampler_path))
    checkpoints = [trained.final_state, sampler]
    log.info("saved and committed " + "; ".join(f"{c.kind} {c.tinker_path} -> {c.url}" for c in checkpoints))
    return Saved(checkpoints=checkpoints,
                 live=LiveReference(eval_loss=loss, greedy_tokens=tokens, base_tokens=base_tokens, prompts=prompts,
                                    examples=examples, from_committed_state=from_committed))
