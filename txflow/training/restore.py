"""What evaluate-restore does on a running cluster: the committed checkpoints, copied back from durable
storage into fresh clients, must reproduce the live model (and the client's own checkpoints, in custom
mode, must load and run); the figures of the mode's quality bar are measured here and judged in
`txflow.training.verdict`."""

from __future__ import annotations

import math
import statistics

from txflow.checkpoints import export, storage
from txflow.cluster.handle import ClusterHandle
from txflow.config import RunConfig
from txflow.log import get_logger, scrub
from txflow.results import RestoreCheck, Saved
from txflow.training import answers, base_figures, evaluation, rl, verdict
from txflow.training.clients import LORA_MODULES, lora_client
from txflow.upstream.skyrl_tx import layout

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


def eval_rewards(sampling_client, cfg: RunConfig, data: rl.RLData, handle: ClusterHandle) -> list[float]:
    """Mean reward of each prompt, `group_size` samples each, with fixed seeds."""
    groups = rl.sample_groups(sampling_client, data, list(range(len(data.prompts))), cfg.rl.group_size,
                              cfg.rl.max_tokens, cfg.rl.temperature, cfg.seed + EVAL_SEED_OFFSET, handle,
                              cfg.step_timeout_s)
    return [statistics.fmean(r.reward for r in group) for group in groups]


def rl_quality(cfg: RunConfig, handle: ClusterHandle, client, sampler, metrics: list[dict],
               data: rl.RLData) -> tuple[dict, bool]:
    """RL's figures: the saved sampler's reward against the base model's, same prompts and seeds, and whether
    another run took the base model's (they are taken once per cluster)."""
    saved = eval_rewards(sampler, cfg, data, handle)
    inputs = {"prompts": data.prompts, "rows": data.rows, "reward": data.reward_spec, "group_size": cfg.rl.group_size,
              "max_tokens": cfg.rl.max_tokens, "temperature": cfg.rl.temperature, "seed": cfg.seed}
    base, was_shared = base_figures.shared(handle, "eval_rewards", inputs, lambda: eval_rewards(
        handle.base_sampler(client), cfg, data, handle))
    return verdict.rl_quality(metrics, saved, base), was_shared


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
                    tokens, logprobs = evaluation.greedy_and_logprobs(sampler, prompts, handle, cfg.step_timeout_s,
                                                                      cfg.seed)
                    if ckpt is last_sampler:  # the one the export step exports: what it must reproduce
                        reference = record_reference(cfg, handle, ckpt.url, prompts, tokens, logprobs,
                                                     {"rank": rank, **modules})
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
    get_logger().info(f"restore check of {len(checks)} client checkpoints: {'FAILED' if failed else 'PASSED'}")
    return RestoreCheck(passed=not failed, checks=checks, reference=reference, failed_checks=failed)


def record_reference(cfg: RunConfig, handle: ClusterHandle, sampler_url: str, prompts: list[list[int]],
                     tokens: list[list[int]], logprobs: list[list[float]], lora: dict) -> export.ExportReference:
    """What the restored sampler computed on fixed prompts (`evaluation.greedy_and_logprobs`), kept in the run
    root: the figures the exported adapter must reproduce outside SkyRL (export-adapter, `txflow export`) on each
    prompt and its greedy tokens, and the slot it was restored into (`txflow serve` loads it so)."""
    reference = export.ExportReference(
        sampler_url=sampler_url, base_model=handle.cluster.base_model_path,
        sequences=[prompt + sampled for prompt, sampled in zip(prompts, tokens)], logprobs=logprobs, prompts=prompts,
        greedy_tokens=tokens, lora=lora)
    export.write_reference(cfg.run_root, cfg.plain_storage_options(), reference)
    return reference


def restore_model_checkpoints(cfg: RunConfig, handle: ClusterHandle, metrics: list[dict], saved: Saved,
                              data) -> RestoreCheck:
    """sft and rl: the committed state and sampler, restored, against the live model's record; the quality
    figures of the mode; the reference figures the export must reproduce."""
    log = get_logger()
    client = handle.service_client()
    timeout = cfg.step_timeout_s
    live = saved.live
    state_url, sampler_url = (next(c.url for c in saved.checkpoints if c.kind == kind)
                              for kind in ("state", "sampler"))
    shared = ["greedy_tokens"] if live.shared_base_tokens else []  # the base model's figures another run took
    restored = lora_client(handle, client, cfg.lora_rank, timeout)
    try:
        # The fresh adapter is zero (LoRA's B starts at 0, at any rank): this is the base model's loss, for free,
        # once per cluster. SFT's bar only: RL's compares rewards, and this forward costs as much as the restored
        # one (6 s of the nightly's).
        base_loss = None
        if cfg.mode == "sft":
            base_loss, was_shared = base_figures.shared(
                handle, "eval_loss", {"examples": live.examples},
                lambda: evaluation.eval_loss(restored, live.examples, handle, timeout))
            shared += ["eval_loss"] if was_shared else []
        load_state(cfg, handle, restored, state_url)
        loss_after = evaluation.eval_loss(restored, live.examples, handle, timeout)
    finally:
        evaluation.unload(handle, restored.model_id)
    sampler, slot = restored_sampler(cfg, handle, client, sampler_url, cfg.lora_rank)
    try:
        tokens, logprobs = evaluation.greedy_and_logprobs(sampler, live.prompts, handle, timeout, cfg.seed)
        reference = record_reference(cfg, handle, sampler_url, live.prompts, tokens, logprobs,
                                     {"rank": cfg.lora_rank, **LORA_MODULES})
        if cfg.mode == "sft":
            quality = verdict.sft_quality(metrics, base_loss, live.eval_loss)
        else:
            quality, was_shared = rl_quality(cfg, handle, client, sampler, metrics, data)
            shared += ["eval_rewards"] if was_shared else []
        rows = data.eval_rows if cfg.mode == "sft" else data.rows
        shown, accuracy = answers.side_by_side(data.tokenizer, rows, live.base_tokens, tokens)
        quality.update(accuracy)
    finally:
        evaluation.unload(handle, slot.model_id)

    abs_diff = abs(loss_after - live.eval_loss)
    tokens_match = tokens == live.greedy_tokens
    moved = live.greedy_tokens != live.base_tokens
    # The restored sampler against the live model's own sampler, token by token (None: no live record).
    logprob_diff = export.max_abs_diff(reference.logprobs, live.logprobs) if live.logprobs else None
    failed = verdict.failed_checks(cfg.mode, abs_diff, tokens_match, moved, quality, logprob_diff)
    result = RestoreCheck(passed=not failed, loss_before=live.eval_loss, loss_after=loss_after, abs_diff=abs_diff,
                          sampler_tokens_match=tokens_match, tokens_differ_from_base=moved,
                          sampler_logprob_diff=logprob_diff, live_tokens=live.greedy_tokens, restored_tokens=tokens,
                          quality=quality, answers=shown, reference=reference, failed_checks=failed,
                          shared_base_figures=shared or None)
    if shared:
        log.info(f"the base model's {', '.join(shared)}: computed once on this cluster, by another run")
    passed = result.passed
    figures = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in quality.items())
    log.info(f"restore check: loss {live.eval_loss:.6f} -> {loss_after:.6f} (|diff| {abs_diff:.2e}), "
             f"greedy tokens match {tokens_match} (and differ from the base model's: {moved}), {figures}: "
             f"{'PASSED' if passed else 'FAILED'}")
    return result
