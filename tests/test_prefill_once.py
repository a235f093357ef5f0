"""The `prefill-once-per-prompt` change: a sampling batch's rows that share a prompt are prefilled once, and every row
still gets what upstream's program gives it (tokens, their logprobs, prompt logprobs), for less compute."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tx.tinker.types import SamplingParams
from tx.utils.generator import GeneratorMixin

from tests.test_scanned_layers import build
from txflow.config import TINY_MODEL
from txflow.upstream.skyrl_tx import models

LENGTH = 24


@pytest.fixture
def upstream_sampling(monkeypatch):
    """Upstream's sampling program as it was, restored after the test whatever it installed."""
    current = GeneratorMixin._prefill_and_decode
    monkeypatch.setattr(GeneratorMixin, "_prefill_and_decode", staticmethod(getattr(current, "upstream", current)))


def batch(prompts: list[list[int]], adapters: list[int]):
    mask = np.zeros((len(prompts), LENGTH), np.int32)
    ids = np.zeros((len(prompts), LENGTH), np.int32)
    for i, prompt in enumerate(prompts):
        ids[i, :len(prompt)], mask[i, :len(prompt)] = prompt, 1
    return jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(adapters, jnp.int32)


def test_rows_that_repeat_a_prompt_for_the_same_adapter_are_prefilled_once():
    a, b = [5, 6, 7], [5, 6, 8]
    # Two RL groups of 4 in a batch of 8: two rows prefilled, each row pointing at its group's.
    unique_rows, row_of = models.shared_prompts(*batch([a] * 4 + [b] * 4, [1] * 8))
    assert unique_rows.tolist() == [0, 4] and row_of.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # The same tokens for another adapter are another prompt; the count is padded to a power of two.
    unique_rows, row_of = models.shared_prompts(*batch([a] * 4 + [a] * 2 + [b] * 2, [1] * 4 + [2] * 4))
    assert unique_rows.tolist() == [0, 4, 6, 0] and row_of.tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    # Only the prompt's own tokens count, not what its padding holds.
    ids, mask, adapters = batch([a, a], [1, 1])
    assert models.shared_prompts(ids.at[1, LENGTH - 1].set(9), mask, adapters)[1].tolist() == [0, 0]
    # Nothing to save: every prompt distinct, or distinct prompts filling the padded count.
    assert models.shared_prompts(*batch([a, b, [1], [2]], [1] * 4)) is None
    assert models.shared_prompts(*batch([a, a, b, [2]], [1] * 4)) is None


def sample(model, mesh, prompts, adapters, prompt_logprobs: bool):
    ids, mask, adapter_indices = batch(prompts, adapters)
    params = [SamplingParams(temperature=1.0 if i % 3 else 0.0, max_tokens=5, seed=11 + i) for i in range(len(ids))]
    with jax.set_mesh(mesh):
        out = model.generate(ids, mask, sampling_params=params, adapter_indices=adapter_indices,
                             prompt_logprobs=prompt_logprobs)
    return out.generated_ids, out.logprobs, out.prompt_logprobs


def test_a_batch_prefilled_once_per_prompt_samples_what_upstreams_program_samples(upstream_sampling):
    model, mesh, _, _ = build(TINY_MODEL)
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(1, 300, n).tolist() for n in (20, 13, 17))
    prompts, adapters = [a] * 3 + [b] * 3 + [c, a], [1, 1, 1, 0, 0, 0, 1, 0]  # a for two adapters; c alone
    assert models.shared_prompts(*batch(prompts, adapters))[0].shape == (4,)
    jax.clear_caches()
    want = sample(model, mesh, prompts, adapters, False)
    models.prefill_once_per_prompt()
    assert GeneratorMixin._prefill_and_decode.upstream is not None
    jax.clear_caches()
    got = sample(model, mesh, prompts, adapters, False)
    assert got[0] == want[0] and len(set(map(tuple, got[0][:3]))) > 1  # a group's samples differ by seed
    for mine, theirs in zip(got[1], want[1]):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-5)


def test_a_batch_that_asks_for_prompt_logprobs_keeps_upstreams_program(upstream_sampling, monkeypatch):
    """txflow's evaluations ask for prompt logprobs and its restore check compares two samplers exactly: their
    batches never take the shorter prefill, whose rounding in bfloat16 depends on which rows repeat."""
    model, mesh, _, _ = build(TINY_MODEL)
    prompts, adapters = [[3, 4, 5] * 6] * 4 + [[7, 8, 9] * 6] * 4, [1] * 8
    want = sample(model, mesh, prompts, adapters, True)
    models.prefill_once_per_prompt()
    planned = []
    monkeypatch.setattr(models, "shared_prompts", lambda *args: planned.append(args) or None)
    assert sample(model, mesh, prompts, adapters, True) == want and planned == []
    sample(model, mesh, prompts, adapters, False)
    assert len(planned) == 1


def test_the_program_prefilled_once_per_prompt_computes_less(upstream_sampling):
    model, mesh, _, _ = build(TINY_MODEL)
    ids, mask, adapters = batch([[3, 4, 5] * 6] * 4 + [[7, 8, 9] * 6] * 4, [1] * 8)  # two groups of 4
    rows = len(ids)
    # The arguments `generate` gives the program: 1 token to sample, no top-k or top-p.
    args = (model, ids, mask, 32, 1, adapters, jnp.ones(rows), jax.vmap(jax.random.PRNGKey)(jnp.arange(rows)),
            jnp.full((rows, 1), -1, jnp.int32), jnp.full(rows, -1, jnp.int32), jnp.ones(rows), 0, False)

    def flops(program, **plan) -> float:
        with jax.set_mesh(mesh):
            cost = program.lower(*args, **plan).compile().cost_analysis()
        return float((cost[0] if isinstance(cost, list) else cost)["flops"])

    upstream = GeneratorMixin._prefill_and_decode
    models.prefill_once_per_prompt()
    unique_rows, row_of = models.shared_prompts(ids, mask, adapters)
    deduplicated = GeneratorMixin._prefill_and_decode.deduplicated
    assert flops(deduplicated, unique_rows=unique_rows, row_of=row_of) < 0.5 * flops(upstream)
