"""The `no-forward-after-the-last-token` change: the sampling program's decoding loop stops one forward pass
earlier than upstream's, and samples what upstream's samples (tokens, their logprobs, stop positions, prompt
logprobs)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tx.models.llama3 import Llama3ForCausalLM
from tx.models.qwen3 import Qwen3ForCausalLM
from tx.tinker.types import SamplingParams
from tx.utils.generator import GeneratorMixin

from tests.test_prefill_once import batch
from tests.test_scanned_layers import build
from txflow.config import TINY_MODEL
from txflow.upstream.skyrl_tx import models

MAX_TOKENS = 5


def upstream_program():
    """Upstream's `_prefill_and_decode`, whichever changes are installed around it."""
    program = GeneratorMixin._prefill_and_decode
    while program is not None:
        if getattr(program, "replaced", None) is not None:
            return program.replaced
        if getattr(program, "upstream", None) is None:
            return program
        program = program.upstream
    raise AssertionError("no sampling program")


@pytest.fixture
def program_in(monkeypatch):
    """Installs the sampling program given (restored after the test); returns the decoding forward passes (with
    a KV cache) the model runs from then on, counted as they run."""
    passes = []
    for model_class in (Llama3ForCausalLM, Qwen3ForCausalLM):
        monkeypatch.setattr(model_class, "__call__", counted(model_class.__call__, passes))

    def use(program):
        monkeypatch.setattr(GeneratorMixin, "_prefill_and_decode", staticmethod(program))
        passes.clear()
        return passes

    return use


def counted(call, passes: list):
    def __call__(self, *args, kv_cache=None, **kwargs):
        if kv_cache is not None:
            jax.debug.callback(lambda: passes.append(1))
        return call(self, *args, kv_cache=kv_cache, **kwargs)

    return __call__


def sample(model, mesh, prompts, stop_tokens, prompt_logprobs: bool):
    ids, mask, adapter_indices = batch(prompts, [1, 0, 1, 1])
    params = [SamplingParams(temperature=0.0 if i < 2 else 0.9, max_tokens=MAX_TOKENS, seed=5 + i,
                             stop_tokens=stop_tokens[i]) for i in range(len(ids))]
    jax.clear_caches()  # a program traced before the passes were counted would count none
    with jax.set_mesh(mesh):
        out = model.generate(ids, mask, sampling_params=params, adapter_indices=adapter_indices,
                             prompt_logprobs=prompt_logprobs)
        jax.effects_barrier()
    return out


@pytest.mark.parametrize("prompt_logprobs", [False, True])
def test_the_loop_samples_what_upstreams_samples_with_one_forward_pass_fewer(program_in, prompt_logprobs):
    model, mesh, _, _ = build(TINY_MODEL)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 300, n).tolist() for n in (19, 11, 16, 7)]
    upstream = upstream_program()
    passes = program_in(upstream)
    free = sample(model, mesh, prompts, [None] * 4, prompt_logprobs)
    assert len(passes) == MAX_TOKENS  # upstream: a forward pass after each token, the last one's unread
    # One sampled row stops at its last token, the other at a token before it (the same seeds draw the same
    # tokens): the stop positions the loop's end and its middle record. Each stop token is one its row draws there
    # first.
    sampled = free.generated_ids[2:]
    end = next(i for i, tokens in enumerate(sampled) if tokens[-1] not in tokens[:-1])
    middle = next(j for j in range(1, MAX_TOKENS - 1) if sampled[1 - end][j] not in sampled[1 - end][:j])
    stops = [None, None, None, None]
    stops[2 + end], stops[3 - end] = [sampled[end][-1]], [sampled[1 - end][middle]]
    passes = program_in(upstream)
    want = sample(model, mesh, prompts, stops, prompt_logprobs)
    assert want.stop_reasons == ["length", "length", "stop", "stop"]
    lengths = [MAX_TOKENS] * 4
    lengths[3 - end] = middle + 1
    assert [len(tokens) for tokens in want.generated_ids] == lengths

    passes = program_in(jax.jit(models.prefill_and_decode, static_argnames=models.SAMPLING_STATIC))
    got = sample(model, mesh, prompts, stops, prompt_logprobs)
    assert len(passes) == MAX_TOKENS - 1
    assert got.generated_ids == want.generated_ids and got.stop_reasons == want.stop_reasons
    assert len(set(map(tuple, got.generated_ids[2:]))) == 2  # the sampled rows drew tokens of their own
    for mine, theirs in zip(got.logprobs, want.logprobs):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)
    if prompt_logprobs:
        for mine, theirs in zip(got.prompt_logprobs, want.prompt_logprobs):
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)


def test_installed_once_under_the_changes_that_wrap_it(program_in):
    program_in(upstream_program())
    models.no_forward_after_the_last_token()
    models.prefill_once_per_prompt()
    models.prompt_logprobs_in_chunks()
    installed = GeneratorMixin._prefill_and_decode
    models.no_forward_after_the_last_token()
    assert GeneratorMixin._prefill_and_decode is installed
    # Both wrappers call this change's program, not upstream's.
    assert installed.upstream.replaced is upstream_program() and installed.upstream.__wrapped__ is \
        models.prefill_and_decode


def test_a_batch_of_no_new_tokens_gives_its_prompt_logprobs_as_upstreams(program_in):
    model, mesh, _, _ = build(TINY_MODEL)
    ids, mask, adapters = batch([[3, 4, 5, 6], [7, 8]], [1, 0])
    params = [SamplingParams(temperature=0.0, max_tokens=0, seed=1)] * 2
    outs = []
    for program in (upstream_program(), jax.jit(models.prefill_and_decode, static_argnames=models.SAMPLING_STATIC)):
        program_in(program)
        with jax.set_mesh(mesh):
            outs.append(model.generate(ids, mask, sampling_params=params, adapter_indices=adapters,
                                       prompt_logprobs=True))
    want, got = outs
    assert got.generated_ids == want.generated_ids == [[], []] and got.stop_reasons == want.stop_reasons
    for mine, theirs in zip(got.prompt_logprobs, want.prompt_logprobs):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)


@pytest.fixture
def draws(monkeypatch):
    """The categorical draws and greedy argmaxes the sampling program runs from then on, counted as they run (a
    branch not taken runs neither)."""
    ran = {"categorical": 0, "argmax": 0}

    def counting(name, draw):
        def counted_draw(*args, **kwargs):
            jax.debug.callback(lambda: ran.__setitem__(name, ran[name] + 1))
            return draw(*args, **kwargs)

        return counted_draw

    monkeypatch.setattr(jax.random, "categorical", counting("categorical", jax.random.categorical))
    monkeypatch.setattr(jax.numpy, "argmax", counting("argmax", jax.numpy.argmax))
    return ran


@pytest.mark.parametrize("temperatures", [(0.0, 0.0, 0.0, 0.0), (0.9, 0.7, 1.0, 0.9), (0.0, 0.9, 0.0, 1.0)],
                         ids=["greedy", "sampled", "mixed"])
def test_each_token_is_drawn_only_the_way_its_batch_needs(program_in, draws, temperatures):
    """`one-draw-per-token`: a batch of greedy rows runs no categorical draw, a batch of sampled rows no greedy
    argmax, and each gives upstream's tokens and logprobs; a mixed batch runs both, as upstream does."""
    model, mesh, _, _ = build(TINY_MODEL)
    rng = np.random.default_rng(4)
    ids, mask, adapter_indices = batch([rng.integers(1, 300, n).tolist() for n in (12, 9, 15, 6)], [1, 0, 1, 1])
    params = [SamplingParams(temperature=t, max_tokens=MAX_TOKENS, seed=11 + i) for i, t in enumerate(temperatures)]
    outs = []
    for program in (upstream_program(), jax.jit(models.prefill_and_decode, static_argnames=models.SAMPLING_STATIC)):
        program_in(program)
        jax.clear_caches()  # a program traced before the draws were counted would count none
        draws.update(categorical=0, argmax=0)
        with jax.set_mesh(mesh):
            outs.append(model.generate(ids, mask, sampling_params=params, adapter_indices=adapter_indices))
            jax.effects_barrier()
    want, got = outs
    assert got.generated_ids == want.generated_ids and got.stop_reasons == want.stop_reasons
    for mine, theirs in zip(got.logprobs, want.logprobs):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)
    greedy_rows = sum(t == 0.0 for t in temperatures)
    assert (draws["categorical"] > 0) == (greedy_rows < len(temperatures))
    assert (draws["argmax"] > 0) == (greedy_rows > 0)
