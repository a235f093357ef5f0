"""Step 6, evaluate-restore: the saved checkpoints reproduce the live model, and
the run reached the quality bar of its mode."""

from __future__ import annotations

import math
import statistics

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.checkpoints import export, storage
from txflow.cluster.handle import ClusterHandle
from txflow.cluster.monitor import retry_unless_cluster_fault
from txflow.config import RunConfig
from txflow.log import get_logger, scrub
from txflow.processes.holds import hold_point
from txflow.results import LiveReference, RestoreCheck, Saved
from txflow.training import evaluation, rl
from txflow.training.clients import LORA_MODULES, lora_client
from txflow.upstream.skyrl_tx import layout

LOSS_TOLERANCE = 1e-6
EVAL_SEED_OFFSET = 7_777_777


def restore(cfg: RunConfig, handle: ClusterHandle, client, state_url: str, rank: int, modules: dict | None = None):
    """A fresh training client holding the state copied back from its durable URL."""
    restored = lora_client(handle, client, rank, cfg.step_timeout_s, modules=modules)
    load_state(cfg, handle, restored, state_url)
    return restored


def load_state(cfg: RunConfig, handle: ClusterHandle, training_client, state_url: str) -> None:
    """Copy the state at `state_url` back from durable storage and load it into `training_client`."""
    path = storage.import_checkpoint(cfg, handle.cluster.checkpoints_base, state_url, "state",
                                     training_client.model_id, "restored")
    handle.wait(training_client.load_state(path), "loading the restored state", cfg.step_timeout_s)


def restored_sampler(cfg: RunConfig, handle: ClusterHandle, client, sampler_url: str, rank: int,
                     modules: dict | None = None):
    """A sampling client on the sampler weights copied back from their durable URL, in a fresh adapter
    slot of its own: were the tarball ignored, it would sample the untrained adapter, not the restored
    state. Returns it and the slot's training client (to unload)."""
    slot = lora_client(handle, client, rank, cfg.step_timeout_s, modules=modules)
    path = storage.import_checkpoint(cfg, handle.cluster.checkpoints_base, sampler_url, "sampler", slot.model_id,
                                     "restored")
    return client.create_sampling_client(model_path=path), slot


# The quality bar of each mode, from scripts/learner_check.py: 10 seeds of the nightly configuration with a
# working learner and 10 with a broken one (README, "Telling a working learner from a broken one").
SFT_MIN_LOSS_GAIN = 0.05  # nats of held-out loss, base model minus trained; working runs gained >= 0.22
RL_MIN_REWARD_GAIN = 0.05  # eval reward, saved sampler minus base model, same prompts and seeds
RL_MAX_P = 0.01  # one-sided exact sign-flip test over the per-prompt differences


def eval_rewards(sampling_client, cfg: RunConfig, data: rl.RLData, handle: ClusterHandle) -> list[float]:
    """Mean reward of each prompt, `group_size` samples each, with fixed seeds."""
    groups = rl.sample_groups(sampling_client, data, list(range(len(data.prompts))), cfg.group_size,
                              cfg.max_tokens, cfg.temperature, cfg.seed + EVAL_SEED_OFFSET, handle,
                              cfg.step_timeout_s)
    return [statistics.fmean(r.reward for r in group) for group in groups]


def quarter_means(metrics: list[dict], key: str) -> tuple[float, float]:
    """Mean of `key` over the first and the last quarter of the steps (at least one step each)."""
    k = max(1, len(metrics) // 4)
    return statistics.fmean(m[key] for m in metrics[:k]), statistics.fmean(m[key] for m in metrics[-k:])


def sft_quality(cfg: RunConfig, handle: ClusterHandle, client, sampler, metrics: list[dict], data,
                live: LiveReference, base_loss: float) -> dict:
    """The held-out loss of the trained model is below the base model's by at least SFT_MIN_LOSS_GAIN."""
    gain = base_loss - live.eval_loss
    return {"base_eval_loss": base_loss, "final_eval_loss": live.eval_loss, "eval_loss_gain": gain,
            "first_step_loss": metrics[0]["nll"], "final_step_loss": metrics[-1]["nll"],
            "quality_passed": gain >= SFT_MIN_LOSS_GAIN}


def rl_quality(cfg: RunConfig, handle: ClusterHandle, client, sampler, metrics: list[dict], data: rl.RLData,
               live: LiveReference, base_loss: float) -> dict:
    """The saved sampler beats the base model on the same prompts and seeds by at least RL_MIN_REWARD_GAIN,
    and on enough prompts that chance is ruled out (sign-flip p <= RL_MAX_P)."""
    saved = eval_rewards(sampler, cfg, data, handle)
    base = eval_rewards(client.create_sampling_client(base_model=handle.cluster.base_model_path), cfg, data, handle)
    gain = statistics.fmean(saved) - statistics.fmean(base)
    p = evaluation.sign_flip_p([s - b for s, b in zip(saved, base)])
    first, last = quarter_means(metrics, "reward_mean")
    figures = {"eval_reward": statistics.fmean(saved), "base_eval_reward": statistics.fmean(base),
               "reward_gain": gain, "sign_flip_p": p, "reward_first_quarter": first, "reward_last_quarter": last,
               "quality_passed": gain >= RL_MIN_REWARD_GAIN and p <= RL_MAX_P}
    if "clip_fraction" in metrics[0]:
        figures["clip_fraction"] = statistics.fmean(m["clip_fraction"] for m in metrics)
    return figures


QUALITY = {"sft": sft_quality, "rl": rl_quality}


def failed_checks(mode: str, abs_diff: float, tokens_match: bool, moved: bool, quality: dict,
                  logprob_diff: float | None = None) -> list[str]:
    """Each check the run missed, with the value found and the bound it had to meet."""
    failed = []
    if not abs_diff <= LOSS_TOLERANCE:
        failed.append(f"restore: |loss after - loss before| {abs_diff:.2e} > {LOSS_TOLERANCE:g} allowed")
    if not tokens_match:
        failed.append("restore: the restored sampler's greedy tokens differ from the live model's")
    if logprob_diff is not None and not logprob_diff <= export.LOGPROB_BOUND:
        failed.append(f"restore: the restored sampler's logprobs differ from the live model's by {logprob_diff:.2e} "
                      f"> {export.LOGPROB_BOUND:g} allowed")
    if not moved:
        failed.append("the trained model's greedy tokens are the base model's: training changed nothing they show")
    if mode == "sft" and quality["eval_loss_gain"] < SFT_MIN_LOSS_GAIN:
        failed.append(f"SFT held-out gain {quality['eval_loss_gain']:.3f} nats < {SFT_MIN_LOSS_GAIN} required")
    if mode == "rl" and quality["reward_gain"] < RL_MIN_REWARD_GAIN:
        failed.append(f"RL reward gain {quality['reward_gain']:.3f} < {RL_MIN_REWARD_GAIN} required")
    if mode == "rl" and quality["sign_flip_p"] > RL_MAX_P:
        failed.append(f"RL sign-flip p {quality['sign_flip_p']:.3g} > {RL_MAX_P} allowed")
    return failed


def verify_client_checkpoints(cfg: RunConfig, handle: ClusterHandle, saved: Saved, data) -> RestoreCheck:
    """custom mode: each state restores from its durable copy and runs a forward pass; each sampler
    loads from its durable copy and samples."""
    client = handle.service_client()
    prompts = [evaluation.prompt_of(e) for e in data.probe]
    samplers = [c for c in saved.checkpoints if c.kind == "sampler"]
    last_sampler = max(samplers, key=lambda c: c.saved_at or 0.0, default=None)
    checks, reference = [], None
    for ckpt in saved.checkpoints:
        check = {"kind": ckpt.kind, "tinker_path": ckpt.tinker_path, "url": ckpt.url}
        model_id = ckpt.tinker_path.removeprefix("tinker://").split("/")[0]
        try:
            # The client chose the rank and the modules; the engine's database knows them for its model.
            lora = layout.model_lora(cfg.resolved_database_url(), model_id)
            rank, modules = lora["rank"], {k: lora[k] for k in LORA_MODULES}
            if ckpt.kind == "state":
                restored = restore(cfg, handle, client, ckpt.url, rank, modules)
                try:
                    check["loss"] = evaluation.eval_loss(restored, data.probe, handle, cfg.step_timeout_s)
                finally:
                    evaluation.unload(handle, restored.model_id)
                check["passed"] = math.isfinite(check["loss"])
            else:
                sampler, slot = restored_sampler(cfg, handle, client, ckpt.url, rank, modules)
                try:
                    tokens = evaluation.greedy_tokens(sampler, prompts, handle, cfg.step_timeout_s, cfg.seed)
                    if ckpt is last_sampler:  # the one the export step exports: what it must reproduce
                        reference = record_reference(cfg, handle, sampler, ckpt.url, [e[0] for e in data.probe],
                                                     prompts, tokens)
                finally:
                    evaluation.unload(handle, slot.model_id)
                check["tokens"] = tokens
                check["passed"] = all(len(t) > 0 for t in tokens)
        except Exception as exc:  # a checkpoint that cannot be loaded fails its check, not the listing
            if handle.monitor.settle():  # ... unless the cluster itself broke: that is a fault to retry
                handle.monitor.raise_if_failed()
            check["passed"], check["error"] = False, scrub(f"{type(exc).__name__}: {exc}")
        checks.append(check)
    failed = [f"restore of {c['kind']} {c['tinker_path']}: {c.get('error') or 'failed'}" for c in checks
              if not c["passed"]] or ([] if checks else ["the client saved no checkpoint to restore"])
    return RestoreCheck(passed=not failed, checks=checks, reference=reference, failed_checks=failed)


def record_reference(cfg: RunConfig, handle: ClusterHandle, sampler, sampler_url: str, sequences: list[list[int]],
                     prompts: list[list[int]], tokens: list[list[int]]) -> export.ExportReference:
    """What the restored sampler computes on fixed sequences and prompts, kept in the run root: the figures
    the exported adapter must reproduce outside SkyRL (export-adapter, `txflow export`)."""
    reference = export.ExportReference(
        sampler_url=sampler_url, base_model=handle.cluster.base_model_path, sequences=sequences,
        logprobs=evaluation.sequence_logprobs(sampler, sequences, handle, cfg.step_timeout_s), prompts=prompts,
        greedy_tokens=tokens)
    export.write_reference(cfg.run_root, cfg.plain_storage_options(), reference)
    return reference


@task(name="evaluate-restore", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_cluster_fault,
      cache_policy=NO_CACHE)
def evaluate_restore(cfg: RunConfig, handle: ClusterHandle, metrics: list[dict], saved: Saved,
                     data) -> RestoreCheck:
    """Restore the state into a fresh training client and sample from the saved sampler weights."""
    log = get_logger()
    log.info(f"evaluate-restore: loading the committed checkpoints of run {cfg.run_id} from {cfg.run_root}")
    hold_point("evaluate-restore")  # a test's fault lands here (txflow.processes.holds)
    with handle.deaths_first():
        if cfg.mode == "custom":
            result = verify_client_checkpoints(cfg, handle, saved, data)
            log.info(f"restore check of {len(result.checks)} client checkpoints: "
                     f"{'PASSED' if result.passed else 'FAILED'}")
            return result
        return restore_model_checkpoints(cfg, handle, metrics, saved, data)


def restore_model_checkpoints(cfg: RunConfig, handle: ClusterHandle, metrics: list[dict], saved: Saved,
                              data) -> RestoreCheck:
    log = get_logger()
    client = handle.service_client()
    timeout = cfg.step_timeout_s
    live = saved.live
    state_url, sampler_url = (next(c.url for c in saved.checkpoints if c.kind == kind)
                              for kind in ("state", "sampler"))
    restored = lora_client(handle, client, cfg.lora_rank, timeout)
    try:
        # The fresh adapter is zero (LoRA's B starts at 0): this is the base model's loss, for free.
        base_loss = evaluation.eval_loss(restored, live.examples, handle, timeout)
        load_state(cfg, handle, restored, state_url)
        loss_after = evaluation.eval_loss(restored, live.examples, handle, timeout)
    finally:
        evaluation.unload(handle, restored.model_id)
    sampler, slot = restored_sampler(cfg, handle, client, sampler_url, cfg.lora_rank)
    try:
        tokens = evaluation.greedy_tokens(sampler, live.prompts, handle, timeout, cfg.seed)
        reference = record_reference(cfg, handle, sampler, sampler_url, [e[0] for e in live.examples], live.prompts,
                                     tokens)
        quality = QUALITY[cfg.mode](cfg, handle, client, sampler, metrics, data, live, base_loss)
    finally:
        evaluation.unload(handle, slot.model_id)

    abs_diff = abs(loss_after - live.eval_loss)
    tokens_match = tokens == live.greedy_tokens
    moved = live.greedy_tokens != live.base_tokens
    # The restored sampler against the live model's own sampler, token by token (None: no live record).
    logprob_diff = export.max_abs_diff(reference.logprobs, live.logprobs) if live.logprobs else None
    failed = failed_checks(cfg.mode, abs_diff, tokens_match, moved, quality, logprob_diff)
    result = RestoreCheck(passed=not failed, loss_before=live.eval_loss, loss_after=loss_after, abs_diff=abs_diff,
                          sampler_tokens_match=tokens_match, tokens_differ_from_base=moved,
                          sampler_logprob_diff=logprob_diff, live_tokens=live.greedy_tokens, restored_tokens=tokens,
                          quality=quality, reference=reference, failed_checks=failed)
    passed = result.passed
    figures = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in quality.items())
    log.info(f"restore check: loss {live.eval_loss:.6f} -> {loss_after:.6f} (|diff| {abs_diff:.2e}), "
             f"greedy tokens match {tokens_match} (and differ from the base model's: {moved}), {figures}: "
             f"{'PASSED' if passed else 'FAILED'}")
    return result
