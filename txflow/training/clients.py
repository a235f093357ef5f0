"""Training clients on a cluster: a fresh one, or one holding a durable state."""

from __future__ import annotations

from txflow.checkpoints import storage
from txflow.cluster.handle import ClusterHandle
from txflow.config import RunConfig


def training_client_at(cfg: RunConfig, handle: ClusterHandle, point: tuple[str, int] | None):
    """A fresh LoRA client on `handle`; given a (URL, step) it first loads that durable state, optimizer included."""
    client = handle.service_client()
    training_client = client.create_lora_training_client(base_model=handle.cluster.base_model_path,
                                                         rank=cfg.lora_rank, seed=cfg.seed)
    if point is None:
        return training_client
    url, step = point
    path = storage.import_checkpoint(cfg, handle.cluster.checkpoints_base, url, "state", training_client.model_id,
                                     f"resume-{step:06d}")
    handle.wait(training_client.load_state_with_optimizer(path), f"loading the state of step {step}",
                cfg.step_timeout_s)
    return training_client
