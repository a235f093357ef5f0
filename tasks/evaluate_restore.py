"""Step 6, evaluate-restore: the saved checkpoints reproduce the live model, and
the run reached the quality bar of its mode."""

from __future__ import annotations

import math
import statistics

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow import evaluation, rl, storage
from txflow.cluster import Cluster, Launcher
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.tinker_client import service_client, wait_result

LOSS_TOLERANCE = 1e-6
EVAL_SEED_OFFSET = 7_777_777


def restore(cfg: RunConfig, cluster: Cluster, launcher: Launcher, client, state_url: str, rank: int):
    """A fresh training client holding the state copied back from its durable URL."""
    restored = client.create_lora_training_client(base_model=cluster.base_model_path, rank=rank)
    path = storage.import_checkpoint(cfg, cluster.checkpoints_base, state_url, "state", restored.model_id, "restored")
    wait_result(restored.load_state(path), cluster, launcher, cfg.step_timeout_s, "loading the restored state")
    return restored


def restored_sampler(cfg: RunConfig, cluster: Cluster, client, restored, sampler_url: str):
    """A sampling client on the sampler weights copied back from their durable URL (in `restored`'s slot)."""
    path = storage.import_checkpoint(cfg, cluster.checkpoints_base, sampler_url, "sampler", restored.model_id,
                                     "restored")
    return client.create_sampling_client(model_path=path)


def mean_eval_reward(sampling_client, cfg: RunConfig, data: rl.RLData, cluster: Cluster, launcher: Launcher) -> float:
    """Mean reward over every prompt, `group_size` samples each, with a fixed seed."""
    groups = rl.sample_groups(sampling_client, data, list(range(len(data.prompts))), cfg.group_size,
                              cfg.max_tokens, cfg.temperature, cfg.seed + EVAL_SEED_OFFSET, cluster, launcher,
                              cfg.step_timeout_s)
    return statistics.fmean(rl.rewards_of(groups))


def quarter_means(metrics: list[dict], key: str) -> tuple[float, float]:
    """Mean of `key` over the first and the last quarter of the steps (at least one step each)."""
    k = max(1, len(metrics) // 4)
    return statistics.fmean(m[key] for m in metrics[:k]), statistics.fmean(m[key] for m in metrics[-k:])


def rl_quality(cfg: RunConfig, cluster: Cluster, launcher: Launcher, client, sampler, metrics: list[dict],
               data: rl.RLData) -> dict:
    """Reward rose during training, and the saved sampler beats the base model on the same prompts and seeds."""
    first, last = quarter_means(metrics, "reward_mean")
    eval_reward = mean_eval_reward(sampler, cfg, data, cluster, launcher)
    base = client.create_sampling_client(base_model=cluster.base_model_path)
    base_reward = mean_eval_reward(base, cfg, data, cluster, launcher)
    return {"reward_first_quarter": first, "reward_last_quarter": last, "reward_rose": last > first,
            "eval_reward": eval_reward, "base_eval_reward": base_reward,
            "quality_passed": last > first and eval_reward > base_reward}


def verify_client_checkpoints(cfg: RunConfig, cluster: Cluster, launcher: Launcher, saved: dict, data) -> dict:
    """custom mode: each state restores from its durable copy and runs a forward pass; each sampler
    loads from its durable copy and samples."""
    client = service_client(cluster)
    rest = client.create_rest_client()
    prompts = [evaluation.prompt_of(e) for e in data.probe]
    checks = []
    for ckpt in saved["checkpoints"]:
        check = {"kind": ckpt["kind"], "tinker_path": ckpt["tinker_path"], "url": ckpt["url"]}
        model_id = ckpt["tinker_path"].removeprefix("tinker://").split("/")[0]
        try:
            if ckpt["kind"] == "state":
                # The client chose the LoRA rank; the engine still knows it for the client's model.
                rank = rest.get_training_run(model_id).result().lora_rank
                restored = restore(cfg, cluster, launcher, client, ckpt["url"], rank)
                try:
                    check["loss"] = evaluation.eval_loss(restored, data.probe, cluster, launcher, cfg.step_timeout_s)
                finally:
                    evaluation.unload(cluster, restored.model_id)
                check["passed"] = math.isfinite(check["loss"])
            else:
                # Into the client's own adapter slot, one request: SkyRL-tx 0.3.0 with 2 processes failed
                # ("passed to device_put is not the same on each process") when a fresh model's sampler
                # requests were batched together.
                path = storage.import_checkpoint(cfg, cluster.checkpoints_base, ckpt["url"], "sampler", model_id,
                                                 "restored")
                sampler = client.create_sampling_client(model_path=path)
                tokens = evaluation.greedy_tokens(sampler, prompts[:1], cluster, launcher, cfg.step_timeout_s,
                                                  cfg.seed)
                check["tokens"] = tokens
                check["passed"] = all(len(t) > 0 for t in tokens)
        except Exception as exc:  # a checkpoint that cannot be loaded fails its check, not the listing
            check["passed"], check["error"] = False, f"{type(exc).__name__}: {exc}"
        checks.append(check)
    return {"checks": checks, "passed": bool(checks) and all(c["passed"] for c in checks)}


@task(name="evaluate-restore", retries=1, retry_delay_seconds=2, cache_policy=NO_CACHE)
def evaluate_restore(cfg: RunConfig, cluster: Cluster, launcher: Launcher, metrics: list[dict], saved: dict,
                     data) -> dict:
    """Restore the state into a fresh training client and sample from the saved sampler weights."""
    log = get_logger()
    if cfg.mode == "custom":
        result = verify_client_checkpoints(cfg, cluster, launcher, saved, data)
        log.info(f"restore check of {len(result['checks'])} client checkpoints: "
                 f"{'PASSED' if result['passed'] else 'FAILED'}")
        return result
    client = service_client(cluster)
    timeout = cfg.step_timeout_s
    live = saved["live"]
    state_url, sampler_url = (next(c["url"] for c in saved["checkpoints"] if c["kind"] == kind)
                              for kind in ("state", "sampler"))
    restored = restore(cfg, cluster, launcher, client, state_url, cfg.lora_rank)
    try:
        loss_after = evaluation.eval_loss(restored, live["examples"], cluster, launcher, timeout)
        sampler = restored_sampler(cfg, cluster, client, restored, sampler_url)
        tokens = evaluation.greedy_tokens(sampler, live["prompts"], cluster, launcher, timeout, cfg.seed)
        rl_result = rl_quality(cfg, cluster, launcher, client, sampler, metrics, data) if cfg.mode == "rl" else None
    finally:
        evaluation.unload(cluster, restored.model_id)

    abs_diff = abs(loss_after - live["eval_loss"])
    result = {
        "loss_before": live["eval_loss"],
        "loss_after": loss_after,
        "abs_diff": abs_diff,
        "sampler_tokens_match": tokens == live["greedy_tokens"],
        "live_tokens": live["greedy_tokens"],
        "restored_tokens": tokens,
    }
    if cfg.mode == "sft":
        result["first_step_loss"], result["final_step_loss"] = metrics[0]["nll"], metrics[-1]["nll"]
        result["quality_passed"] = result["loss_fell"] = metrics[-1]["nll"] < metrics[0]["nll"]
        quality = f"training loss {metrics[0]['nll']:.4f} -> {metrics[-1]['nll']:.4f}"
    else:
        result |= rl_result
        quality = (f"reward {result['reward_first_quarter']:.4f} -> {result['reward_last_quarter']:.4f}; "
                   f"eval reward {result['eval_reward']:.4f} saved vs {result['base_eval_reward']:.4f} base")
    result["passed"] = abs_diff <= LOSS_TOLERANCE and result["sampler_tokens_match"] and result["quality_passed"]
    log.info(f"restore check: loss {live['eval_loss']:.6f} -> {loss_after:.6f} (|diff| {abs_diff:.2e}), "
             f"greedy tokens match {result['sampler_tokens_match']}, {quality}: "
             f"{'PASSED' if result['passed'] else 'FAILED'}")
    return result
