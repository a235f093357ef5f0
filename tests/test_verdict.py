"""The run's verdict, check by check: each passes at its bound, fails just past it, and says which check
failed with the value found and the bound. The figures are literal, so a changed bound fails its test."""

from __future__ import annotations

import math

import pytest

from txflow.training import verdict

SFT_OK = {"eval_loss_gain": 0.05}
RL_OK = {"reward_gain": 0.05, "sign_flip_p": 0.01}


def failed(mode="sft", abs_diff=0.0, tokens_match=True, moved=True, quality=None, logprob_diff=None):
    quality = quality if quality is not None else (SFT_OK if mode == "sft" else RL_OK)
    return verdict.failed_checks(mode, abs_diff, tokens_match, moved, quality, logprob_diff)


def test_a_run_at_every_bound_passes():
    assert failed("sft", abs_diff=1e-6, logprob_diff=1e-4) == []
    assert failed("rl", abs_diff=1e-6, logprob_diff=1e-4) == []


@pytest.mark.parametrize("abs_diff", [1.01e-6, 1e-3, math.nan])
def test_a_restored_loss_past_one_in_a_million_fails(abs_diff):
    found = failed(abs_diff=abs_diff)
    assert len(found) == 1 and found[0].startswith("restore: |loss after - loss before|"), found
    assert "> 1e-06 allowed" in found[0]


def test_restored_greedy_tokens_that_differ_fail():
    assert failed(tokens_match=False) == ["restore: the restored sampler's greedy tokens differ from the live model's"]


@pytest.mark.parametrize("diff", [1.01e-4, math.nan])
def test_restored_logprobs_past_the_export_bound_fail(diff):
    found = failed(logprob_diff=diff)
    assert len(found) == 1 and "logprobs differ from the live model's by" in found[0] and "> 0.0001 allowed" in found[0]


def test_no_logprob_record_is_no_logprob_check():
    assert failed(logprob_diff=None) == []


def test_a_model_whose_greedy_tokens_did_not_move_fails():
    assert failed(moved=False) == ["the trained model's greedy tokens are the base model's: training changed "
                                   "nothing they show"]


@pytest.mark.parametrize("gain", [0.0499, -3.14, math.nan])
def test_an_sft_gain_below_five_hundredths_of_a_nat_fails(gain):
    found = failed("sft", quality={"eval_loss_gain": gain})
    assert found == [f"SFT held-out gain {gain:.3f} nats < 0.05 required"]


@pytest.mark.parametrize("gain", [0.0499, -0.2])
def test_an_rl_reward_gain_below_five_hundredths_fails(gain):
    assert failed("rl", quality={"reward_gain": gain, "sign_flip_p": 0.001}) == [
        f"RL reward gain {gain:.3f} < 0.05 required"]


@pytest.mark.parametrize("p", [0.0101, 0.5])
def test_an_rl_gain_that_chance_explains_fails(p):
    assert failed("rl", quality={"reward_gain": 0.5, "sign_flip_p": p}) == [f"RL sign-flip p {p:.3g} > 0.01 allowed"]


def test_each_mode_is_judged_by_its_own_bar_only():
    assert failed("sft", quality={"eval_loss_gain": 1.0, "reward_gain": -1.0, "sign_flip_p": 1.0}) == []
    assert failed("rl", quality={"reward_gain": 0.5, "sign_flip_p": 0.0, "eval_loss_gain": -1.0}) == []


def test_every_failed_check_is_listed():
    found = failed("rl", abs_diff=1.0, tokens_match=False, moved=False,
                   quality={"reward_gain": 0.0, "sign_flip_p": 1.0}, logprob_diff=1.0)
    assert len(found) == 6, found


def test_sft_quality_figures_and_bar():
    metrics = [{"step": 1, "nll": 5.0}, {"step": 2, "nll": 4.0}]
    figures = verdict.sft_quality(metrics, base_loss=1.05, trained_loss=1.0)
    assert figures == {"base_eval_loss": 1.05, "final_eval_loss": 1.0, "eval_loss_gain": pytest.approx(0.05),
                       "first_step_loss": 5.0, "final_step_loss": 4.0, "quality_passed": True}
    assert verdict.sft_quality(metrics, 1.0499, 1.0)["quality_passed"] is False


def test_rl_quality_figures_and_bar():
    metrics = [{"step": s, "reward_mean": r, "clip_fraction": c} for s, r, c in [(1, 0.1, 0.0), (2, 0.2, 0.2),
                                                                                  (3, 0.3, 0.1), (4, 0.4, 0.1)]]
    # Six prompts, each better by 0.1: the sign-flip p is 1/64 > 0.01, so the bar is missed on chance alone.
    figures = verdict.rl_quality(metrics, saved=[0.6] * 6, base=[0.5] * 6)
    assert figures["reward_gain"] == pytest.approx(0.1) and figures["sign_flip_p"] == pytest.approx(1 / 64)
    assert (figures["reward_first_quarter"], figures["reward_last_quarter"]) == (0.1, 0.4)
    assert figures["clip_fraction"] == pytest.approx(0.1) and figures["quality_passed"] is False
    # Seven prompts: p = 1/128 <= 0.01.
    assert verdict.rl_quality(metrics, saved=[0.6] * 7, base=[0.5] * 7)["quality_passed"] is True
