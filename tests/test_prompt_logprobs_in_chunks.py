"""The `prompt-logprobs-in-chunks` change: a sampling batch that asks for prompt logprobs computes them a chunk of
positions at a time, and gives what upstream's program gives (tokens, their logprobs, prompt logprobs) for a
fraction of its memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tx.utils.generator import GeneratorMixin

from tests.test_prefill_once import batch, sample, upstream_sampling  # noqa: F401 (a fixture)
from tests.test_scanned_layers import build
from txflow.config import TINY_MODEL
from txflow.upstream.skyrl_tx import models

CHUNK = 40  # positions: the batch below has 8 x 23 of them, so several chunks and a padded last one


def test_prompt_logprobs_in_chunks_are_upstreams_figures(upstream_sampling, monkeypatch):  # noqa: F811
    model, mesh, _, _ = build(TINY_MODEL)
    monkeypatch.setattr(models, "LOGPROBS_CHUNK", CHUNK)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 300, n).tolist() for n in (24, 5, 17, 9, 24, 12, 2, 20)]
    adapters = [1, 0, 1, 1, 0, 1, 0, 1]  # the adapter's LoRA in the head's inputs, and the base model's
    jax.clear_caches()
    want = sample(model, mesh, prompts, adapters, True)
    models.prompt_logprobs_in_chunks()
    assert GeneratorMixin._prefill_and_decode.in_chunks is not None
    jax.clear_caches()
    got = sample(model, mesh, prompts, adapters, True)
    assert got[0] == want[0]
    for mine, theirs in [*zip(got[1], want[1]), *zip(got[2], want[2])]:
        assert len(mine) == len(theirs)
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-5)
    assert [len(p) for p in got[2]] == [len(p) - 1 for p in prompts]  # every prompt token after the first


def test_the_program_in_chunks_never_holds_every_positions_logits(upstream_sampling, monkeypatch):  # noqa: F811
    model, mesh, _, _ = build(TINY_MODEL)
    monkeypatch.setattr(models, "LOGPROBS_CHUNK", CHUNK)
    ids, mask, adapters = batch([[3, 4, 5] * 8] * 8, [1] * 8)
    rows, length, vocab = *ids.shape, model.config.vocab_size
    # The arguments `generate` gives the program: 1 token to sample, no top-k or top-p, prompt logprobs.
    args = (model, ids, mask, 32, 1, adapters, jnp.ones(rows), jax.vmap(jax.random.PRNGKey)(jnp.arange(rows)),
            jnp.full((rows, 1), -1, jnp.int32), jnp.full(rows, -1, jnp.int32), jnp.ones(rows), 0, False)

    def holds_every_positions_logits(program) -> bool:
        with jax.set_mesh(mesh):
            text = program.lower(*args, prompt_logprobs=True).compile().as_text()
        return any(f"[{rows},{positions},{vocab}]" in text for positions in (length, length - 1))

    upstream = GeneratorMixin._prefill_and_decode
    models.prompt_logprobs_in_chunks()
    assert holds_every_positions_logits(upstream)
    assert not holds_every_positions_logits(GeneratorMixin._prefill_and_decode.in_chunks)
