"""The run's verdict: the quality bar of each mode and every check of evaluate-restore, as pure functions
of the figures measured (each check has its unit test in tests/test_verdict.py)."""

from __future__ import annotations

import statistics

from txflow.training.evaluation import sign_flip_p

LOSS_TOLERANCE = 1e-6  # |held-out loss of the restored state - the live model's|: a restore is exact
# |logprob of the restored sampler - the live model's| per token: one engine computing the same weights, so only
# the batch's shape rounds differently (the export's bound, between two programs, is export.LOGPROB_BOUND)
SAMPLER_TOLERANCE = 1e-4

# The quality bar of each mode, from scripts/learner_check.py: 10 seeds of the nightly configuration with a
# working learner and 10 with a broken one (docs/modes.md, "Telling a working learner from a broken one").
SFT_MIN_LOSS_GAIN = 0.05  # nats of held-out loss, base model minus trained; working runs gained >= 0.22
RL_MIN_REWARD_GAIN = 0.05  # eval reward, saved sampler minus base model, same prompts and seeds
RL_MAX_P = 0.01  # one-sided exact sign-flip test over the per-prompt differences


def quarter_means(metrics: list[dict], key: str) -> tuple[float, float]:
    """Mean of `key` over the first and the last quarter of the steps (at least one step each)."""
    k = max(1, len(metrics) // 4)
    return statistics.fmean(m[key] for m in metrics[:k]), statistics.fmean(m[key] for m in metrics[-k:])


def sft_quality(metrics: list[dict], base_loss: float, trained_loss: float) -> dict:
    """The held-out loss of the trained model is below the base model's by at least SFT_MIN_LOSS_GAIN."""
    gain = base_loss - trained_loss
    return {"base_eval_loss": base_loss, "final_eval_loss": trained_loss, "eval_loss_gain": gain,
            "first_step_loss": metrics[0]["nll"], "final_step_loss": metrics[-1]["nll"],
            "quality_passed": gain >= SFT_MIN_LOSS_GAIN}


def rl_quality(metrics: list[dict], saved: list[float], base: list[float]) -> dict:
    """The saved sampler beats the base model on the same prompts and seeds (`saved`, `base`: mean reward per
    prompt) by at least RL_MIN_REWARD_GAIN, on enough prompts that chance is ruled out (sign-flip p <=
    RL_MAX_P)."""
    gain = statistics.fmean(saved) - statistics.fmean(base)
    p = sign_flip_p([s - b for s, b in zip(saved, base)])
    first, last = quarter_means(metrics, "reward_mean")
    figures = {"eval_reward": statistics.fmean(saved), "base_eval_reward": statistics.fmean(base),
               "reward_gain": gain, "sign_flip_p": p, "reward_first_quarter": first, "reward_last_quarter": last,
               "quality_passed": gain >= RL_MIN_REWARD_GAIN and p <= RL_MAX_P}
    if "clip_fraction" in metrics[0]:
        figures["clip_fraction"] = statistics.fmean(m["clip_fraction"] for m in metrics)
    return figures


def failed_checks(mode: str, abs_diff: float, tokens_match: bool, moved: bool, quality: dict,
                  logprob_diff: float | None = None) -> list[str]:
    """Each check the run missed, with the value found and the bound it had to meet ([] when it passed)."""
    failed = []
    if not abs_diff <= LOSS_TOLERANCE:
        failed.append(f"restore: |loss after - loss before| {abs_diff:.2e} > {LOSS_TOLERANCE:g} allowed")
    if not tokens_match:
        failed.append("restore: the restored sampler's greedy tokens differ from the live model's")
    if logprob_diff is not None and not logprob_diff <= SAMPLER_TOLERANCE:
        failed.append(f"restore: the restored sampler's logprobs differ from the live model's by {logprob_diff:.2e} "
                      f"> {SAMPLER_TOLERANCE:g} allowed")
    if not moved:
        failed.append("the trained model's greedy tokens are the base model's: training changed nothing they show")
    if mode == "sft" and not quality["eval_loss_gain"] >= SFT_MIN_LOSS_GAIN:
        failed.append(f"SFT held-out gain {quality['eval_loss_gain']:.3f} nats < {SFT_MIN_LOSS_GAIN} required")
    if mode == "rl" and not quality["reward_gain"] >= RL_MIN_REWARD_GAIN:
        failed.append(f"RL reward gain {quality['reward_gain']:.3f} < {RL_MIN_REWARD_GAIN} required")
    if mode == "rl" and not quality["sign_flip_p"] <= RL_MAX_P:
        failed.append(f"RL sign-flip p {quality['sign_flip_p']:.3g} > {RL_MAX_P} allowed")
    return failed
