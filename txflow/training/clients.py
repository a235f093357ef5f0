"""Training clients on a cluster: a fresh one, or one holding a durable state."""

from __future__ import annotations

from txflow.checkpoints import storage
from txflow.cluster.handle import ClusterHandle
from txflow.config import RunConfig

# The adapter txflow's sft and rl modes train: attention and MLP (as SkyRL-tx always trained them), not the
# unembedding the Tinker SDK asks for by default, so that the exported adapter serves on vLLM unmerged.
# Every client that restores or samples such an adapter must ask for the same modules.
LORA_MODULES = {"train_attn": True, "train_mlp": True, "train_unembed": False}


def lora_client(handle: ClusterHandle, service_client, rank: int, timeout_s: float, seed: int | None = None,
                modules: dict | None = None):
    """A fresh LoRA training client of `rank` on `modules` (default: txflow's own, `LORA_MODULES`). The SDK
    waits for the engine to create the model inside the call, so a death abandons it (`ClusterHandle.call`)."""
    return handle.call(lambda: service_client.create_lora_training_client(
        base_model=handle.cluster.base_model_path, rank=rank, seed=seed, **(modules or LORA_MODULES)),
        "creating a training client", timeout_s)


def sampling_client_of(handle: ClusterHandle, training_client, timeout_s: float):
    """`save_weights_and_get_sampling_client()`, abandoned on a death like every wait on the engine."""
    return handle.call(training_client.save_weights_and_get_sampling_client, "saving weights for a sampler",
                       timeout_s)


def training_client_at(cfg: RunConfig, handle: ClusterHandle, point: tuple[str, int] | None):
    """A fresh LoRA client on `handle`; given a (URL, step) it first loads that durable state, optimizer included."""
    training_client = lora_client(handle, handle.service_client(), cfg.lora_rank, cfg.step_timeout_s, cfg.seed)
    if point is None:
        return training_client
    url, step = point
    path = storage.import_checkpoint(cfg, handle.cluster.checkpoints_base, url, "state", training_client.model_id,
                                     f"resume-{step:06d}")
    # A resume continues the run, so Adam's moments and step count come back too: `load_state` would give
    # the next step a fresh optimizer's update (the `load-optimizer-flag` change).
    handle.wait(training_client.load_state_with_optimizer(path), f"loading the state of step {step}",
                cfg.step_timeout_s)
    return training_client
