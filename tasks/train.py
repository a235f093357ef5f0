"""Step 3, train: sft, rl or a custom client, with periodic save_state so a
retry resumes from the last saved step instead of step 0."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any

import tinker
from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow import custom, rl, sft, storage
from txflow.cluster import Cluster, Launcher
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.progress import StepProgress
from txflow.run_files import append_metric, read_metrics, write_metrics
from txflow.tinker_client import service_client, wait_result


@dataclass
class Trained:
    """The live model after the train step, for save-checkpoint and evaluate-restore."""

    training_client: Any
    metrics: list[dict]
    resumed_from_step: int = 0
    extra: dict = field(default_factory=dict)


def resume_point(cfg: RunConfig) -> tuple[str, int] | None:
    """(URL, step) of the state to continue from: this run's latest committed state (a retry),
    else the one `--resume-from` names, else None."""
    options = cfg.plain_storage_options()
    own = storage.latest_state(cfg.run_root, options)
    if own is not None:
        return own.url, storage.step_of(own.path)
    return storage.resolve_resume_from(cfg) if cfg.resume_from else None


def _training_client(cfg: RunConfig, cluster: Cluster, launcher: Launcher):
    """A fresh LoRA client; on a resume it loads the durable state (with its optimizer) first."""
    client = service_client(cluster)
    training_client = client.create_lora_training_client(base_model=cluster.base_model_path, rank=cfg.lora_rank,
                                                         seed=cfg.seed)
    point = resume_point(cfg)
    if point is None:
        return training_client, 0
    url, step = point
    path = storage.import_checkpoint(cfg, cluster.checkpoints_base, url, "state", training_client.model_id,
                                     f"resume-{step:06d}")
    wait_result(training_client.load_state_with_optimizer(path), cluster, launcher, cfg.step_timeout_s,
                f"loading the state of step {step}")
    get_logger().info(f"resumed from step {step}: {url}")
    return training_client, step


def save_progress(cfg: RunConfig, cluster: Cluster, launcher: Launcher, training_client, step: int) -> str:
    """save_state at `step` and commit it to the run root, so that a retry resumes there."""
    future = training_client.save_state(storage.checkpoint_name(step))
    saved = wait_result(future, cluster, launcher, cfg.step_timeout_s, f"save_state at step {step}")
    url = storage.commit(cfg, cluster.checkpoints_base, saved.path)
    get_logger().info(f"saved state at step {step}: {url}")
    return url


def sft_step(cfg: RunConfig, cluster: Cluster, launcher: Launcher, data: sft.SFTData):
    """One SFT step: cross-entropy on a batch; returns its metrics."""
    adam = tinker.types.AdamParams(learning_rate=cfg.learning_rate)

    def step_fn(training_client, step: int) -> dict:
        batch = [data.train[i] for i in sft.batch_indices(len(data.train), step, cfg.batch_size, cfg.seed)]
        # Both requests in flight before either is awaited, as the Tinker cookbook does.
        fwd_bwd = training_client.forward_backward([sft.to_datum(e) for e in batch], "cross_entropy")
        optim = training_client.optim_step(adam)
        output = wait_result(fwd_bwd, cluster, launcher, cfg.step_timeout_s, f"forward_backward of step {step + 1}")
        wait_result(optim, cluster, launcher, cfg.step_timeout_s, f"optim_step of step {step + 1}")
        nll, tokens = sft.mean_nll(output, batch)
        return {"nll": nll, "tokens": tokens}

    return step_fn


def rl_step(cfg: RunConfig, cluster: Cluster, launcher: Launcher, data: rl.RLData):
    """One RL step: sample groups with the current policy, score, update; returns its metrics."""
    adam = tinker.types.AdamParams(learning_rate=cfg.learning_rate)

    def step_fn(training_client, step: int) -> dict:
        policy = training_client.save_weights_and_get_sampling_client()
        indices = sft.batch_indices(len(data.prompts), step, cfg.batch_size, cfg.seed)
        groups = rl.sample_groups(policy, data, indices, cfg.group_size, cfg.max_tokens, cfg.temperature,
                                  cfg.seed * 100_003 + step, cluster, launcher, cfg.step_timeout_s)
        fwd_bwd = training_client.forward_backward(rl.to_datums(groups, data), cfg.loss)
        optim = training_client.optim_step(adam)
        wait_result(fwd_bwd, cluster, launcher, cfg.step_timeout_s, f"forward_backward of step {step + 1}")
        wait_result(optim, cluster, launcher, cfg.step_timeout_s, f"optim_step of step {step + 1}")
        rewards = rl.rewards_of(groups)
        return {"reward_mean": statistics.fmean(rewards), "reward_std": statistics.pstdev(rewards),
                "tokens_sampled": sum(len(r.tokens) for g in groups for r in g)}

    return step_fn


def train_loop(cfg: RunConfig, cluster: Cluster, launcher: Launcher, step_fn) -> Trained:
    """Steps from the resume point to `cfg.steps`: metrics per step, a durable save every `save_every`."""
    log = get_logger()
    training_client, start = _training_client(cfg, cluster, launcher)
    metrics = read_metrics(cfg.state_dir, up_to_step=start)
    write_metrics(cfg.state_dir, metrics)
    bar = StepProgress(cfg.steps, start, cfg.run_id)
    try:
        for step in range(start, cfg.steps):
            began = time.monotonic()
            row = {"step": step + 1, **step_fn(training_client, step), "seconds": 0.0}
            row["seconds"] = round(time.monotonic() - began, 3)
            metrics.append(row)
            append_metric(cfg.state_dir, row)
            values = " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in row.items() if k != "step")
            log.info(f"step {step + 1}/{cfg.steps} {values}")
            headline = next(k for k in row if k != "step")
            bar.update(step + 1, **{headline: f"{row[headline]:.3f}"})
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
                save_progress(cfg, cluster, launcher, training_client, step + 1)
    finally:
        bar.close()
    return Trained(training_client=training_client, metrics=metrics, resumed_from_step=start)


def train_custom(cfg: RunConfig, cluster: Cluster, launcher: Launcher, data: custom.CustomData) -> Trained:
    log = get_logger()
    values = {"base_url": cluster.base_url, "base_model": cluster.base_model_path, "run_id": cfg.run_id,
              "checkpoint_root": cfg.run_root}
    command = data.command + custom.fill(cfg.client_args, values)
    log.info(f"custom client: {' '.join(command)}")
    log_path = Path(cfg.state_dir) / "logs" / "client.log"
    seconds = custom.run_client(command, custom.client_env(cluster), log_path, cluster, launcher, log.info)
    log.info(f"custom client finished in {seconds:.1f} s")
    return Trained(training_client=None, metrics=[{"step": 1, "seconds": round(seconds, 3)}])


# No task-level retries: a retry needs a fresh cluster, which the flow provisions (and the
# train step then resumes from the last durable state).
@task(name="train", retries=0, cache_policy=NO_CACHE)
def train(cfg: RunConfig, cluster: Cluster, launcher: Launcher, data: Any) -> Trained:
    """Run the training of `cfg.mode` against the cluster."""
    if cfg.mode == "custom":
        return train_custom(cfg, cluster, launcher, data)
    step_fn = (sft_step if cfg.mode == "sft" else rl_step)(cfg, cluster, launcher, data)
    return train_loop(cfg, cluster, launcher, step_fn)
