"""One greedy call per prompt gives evaluate-restore and the export reference both the greedy tokens and the
logprobs of prompt + tokens (`evaluation.greedy_and_logprobs`), with a stand-in sampler (no cluster): the prompt's
logprobs as Tinker gives them (None first), then each sampled token's. tests/test_sft_e2e.py checks the figures
through a real cluster: the restored sampler against the live one, and the export against them."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from txflow.training import evaluation


class Sampler:
    """Each prompt's logprobs are -token / 100 (None first), its greedy tokens the prompt's last + 1, + 2, with
    logprobs -0.5, -0.25; `sampled_logprobs` can drop one to model a short answer."""

    def __init__(self, sampled_logprobs=(-0.5, -0.25)):
        self.sampled_logprobs = list(sampled_logprobs)
        self.asked = []

    def sample(self, prompt, num_samples, sampling_params, include_prompt_logprobs=False):
        tokens = prompt.to_ints()
        self.asked.append((tokens, include_prompt_logprobs, sampling_params.temperature))
        future = Future()
        future.set_result(SimpleNamespace(
            sequences=[SimpleNamespace(tokens=[tokens[-1] + 1, tokens[-1] + 2], logprobs=self.sampled_logprobs,
                                       stop_reason="length")],
            prompt_logprobs=[None, *(-t / 100 for t in tokens[1:])]))
        return future


HANDLE = SimpleNamespace(wait=lambda future, what, timeout_s: future.result())


def test_the_greedy_tokens_come_with_the_logprobs_of_prompt_and_tokens_from_one_call():
    sampler = Sampler()
    tokens, logprobs = evaluation.greedy_and_logprobs(sampler, [[5, 6, 7], [9]], HANDLE, 10.0, seed=0)
    assert tokens == [[8, 9], [10, 11]]
    # Every token after the first of [5, 6, 7, 8, 9] and of [9, 10, 11]: the prompt's, then the sampled ones'.
    assert logprobs == [[-0.06, -0.07, -0.5, -0.25], [-0.5, -0.25]]
    # One greedy request per prompt, with its prompt logprobs: the shape of every evaluation (one program).
    assert [(asked, plp, temperature) for asked, plp, temperature in sampler.asked] == [
        ([5, 6, 7], True, 0.0), ([9], True, 0.0)]
    assert tokens == evaluation.greedy_tokens(Sampler(), [[5, 6, 7], [9]], HANDLE, 10.0, seed=0)


def test_a_sampler_that_leaves_out_a_logprob_is_an_error_not_a_shorter_reference():
    with pytest.raises(RuntimeError, match="gave 1 logprobs for 2 sampled tokens"):
        evaluation.greedy_and_logprobs(Sampler(sampled_logprobs=[-0.5]), [[5, 6, 7]], HANDLE, 10.0, seed=0)
