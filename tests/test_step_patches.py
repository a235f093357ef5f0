"""The `loss-chunks` and `lora-per-example` changes: the chunked logprobs of a batch cover its tokens, not a multiple of
`loss_chunk_size`; a LoRA linear layer computes each example's own adapter, with upstream's outputs and
gradients, and so does an embedding's LoRA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tx.layers.lora import LoRAEmbed, LoRALinear
from tx.utils.logits_processor import LogitsProcessorMixin

from txflow.upstream.skyrl_tx import ranks


@pytest.mark.parametrize(("tokens", "chunk", "expected"), [(192, 1024, 192), (1024, 1024, 1024), (1025, 1024, 513),
                                                            (1100, 1024, 550), (4096, 1024, 1024), (1, 1024, 1)])
def test_chunks_are_as_few_as_the_bound_needs_and_as_even_as_can_be(tokens, chunk, expected):
    assert ranks.balanced_chunk(tokens, chunk) == expected
    chunks = -(-tokens // expected)
    assert chunks == -(-tokens // chunk) and chunks * expected - tokens < chunks  # below a token per chunk


class Head(LogitsProcessorMixin):
    """A vocabulary of 50 over a hidden size of 8; records the token count of every chunk it projects."""

    def __init__(self):
        self.weight = jax.random.normal(jax.random.key(0), (8, 50))
        self.seen = []

    def get_model_config(self):
        return type("Config", (), {"loss_chunk_size": 1024, "gradient_checkpointing": False})()

    def get_lm_head(self):
        def head(hidden, adapter_indices=None):
            self.seen.append(hidden.shape[0])
            return hidden @ self.weight
        return head


def test_a_small_batch_projects_its_own_tokens_and_gets_the_same_logprobs(monkeypatch):
    monkeypatch.setattr(LogitsProcessorMixin, "_compute_chunked_logprobs",
                        LogitsProcessorMixin._compute_chunked_logprobs)  # restored after the test
    hidden = jax.random.normal(jax.random.key(1), (4, 48, 8))
    targets = jnp.asarray(np.random.default_rng(0).integers(0, 50, (4, 48)))
    head = Head()
    exact = LogitsProcessorMixin.logits_to_logprobs(hidden @ head.weight, targets)
    ranks.loss_chunks_fit_the_batch()
    chunked = head.compute_logprobs(hidden, targets, jnp.zeros(4, jnp.int32))
    assert head.seen == [192]  # upstream projected 1024 rows, 832 of them padding
    np.testing.assert_allclose(chunked, exact, rtol=1e-5, atol=1e-5)


def test_each_examples_adapter_gives_upstreams_outputs_and_gradients(monkeypatch):
    monkeypatch.setattr(LoRALinear, "apply_lora", LoRALinear.apply_lora)  # restored after the test
    with jax.set_mesh(jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)):
        layer = LoRALinear(16, 24, sharding=(None, None), max_lora_adapters=4, max_lora_rank=4, use_bias=False,
                           kernel_init=nnx.initializers.normal(), rngs=nnx.Rngs(0))
        layer.lora_A[...] = jax.random.normal(jax.random.key(1), layer.lora_A[...].shape)
        layer.lora_B[...] = jax.random.normal(jax.random.key(2), layer.lora_B[...].shape)
        layer.lora_scaling[...] = jnp.array([1.0, 2.0, 0.5, 3.0])
        x = jax.random.normal(jax.random.key(3), (3, 5, 16))
        adapters = jnp.array([2, 0, 2])  # two examples share a slot, two slots are unused

        def outputs_and_gradients():
            grads = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x, adapters))))(layer)
            return layer(x, adapters), (grads["lora_A"][...], grads["lora_B"][...])

        upstream_out, upstream_grads = outputs_and_gradients()
        ranks.lora_computes_each_examples_adapter()
        out, grads = outputs_and_gradients()
    assert LoRALinear.apply_lora is ranks.lora_per_example
    np.testing.assert_allclose(out, upstream_out, rtol=1e-5, atol=1e-4)
    for got, expected in zip(grads, upstream_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
        assert not np.any(np.asarray(got)[[1, 3]])  # unused slots get no gradient


def test_each_examples_embedding_adapter_gives_upstreams_outputs_and_gradients(monkeypatch):
    monkeypatch.setattr(LoRAEmbed, "apply_lora", LoRAEmbed.apply_lora)  # restored after the test
    with jax.set_mesh(jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)):
        embed = LoRAEmbed(40, 16, sharding=(None, None), max_lora_adapters=4, max_lora_rank=4,
                          embedding_init=nnx.initializers.normal(), rngs=nnx.Rngs(0))
        embed.lora_A[...] = jax.random.normal(jax.random.key(1), embed.lora_A[...].shape)
        embed.lora_B[...] = jax.random.normal(jax.random.key(2), embed.lora_B[...].shape)
        embed.lora_scaling[...] = jnp.array([1.0, 2.0, 0.5, 3.0])
        tokens = jnp.asarray(np.random.default_rng(3).integers(0, 40, (3, 5)))
        adapters = jnp.array([2, 0, 2])

        def outputs_and_gradients():
            grads = nnx.grad(lambda m: jnp.sum(jnp.sin(m(tokens, adapters))))(embed)
            return embed(tokens, adapters), (grads["lora_A"][...], grads["lora_B"][...])

        upstream_out, upstream_grads = outputs_and_gradients()
        LoRAEmbed.apply_lora = ranks.embed_lora_per_example
        out, grads = outputs_and_gradients()
    np.testing.assert_allclose(out, upstream_out, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, upstream_grads, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        assert np.abs(np.asarray(got)[2]).sum() > 0 and not np.any(np.asarray(got)[[1, 3]])


def test_a_decoding_step_of_more_rows_than_slots_reads_every_slot_in_place_with_the_same_outputs(monkeypatch):
    monkeypatch.setattr(LoRALinear, "apply_lora", LoRALinear.apply_lora)  # restored after the test
    ranks.lora_computes_each_examples_adapter()
    with jax.set_mesh(jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)):
        layer = LoRALinear(16, 24, sharding=(None, None), max_lora_adapters=4, max_lora_rank=4, use_bias=False,
                           kernel_init=nnx.initializers.normal(), rngs=nnx.Rngs(0))
        layer.lora_A[...] = jax.random.normal(jax.random.key(1), layer.lora_A[...].shape)
        layer.lora_B[...] = jax.random.normal(jax.random.key(2), layer.lora_B[...].shape)
        layer.lora_scaling[...] = jnp.array([1.0, 2.0, 0.5, 3.0])
        adapters = jnp.array([2, 0, 2, 3, 1, 1])  # 6 rows, 4 slots
        step = jax.random.normal(jax.random.key(3), (6, 1, 16))  # one token a row: a decoding step
        # Each row's own adapter, computed by the gather the longer calls use (a prompt: more than one token).
        prompt = jnp.concatenate([step, step], axis=1)
        np.testing.assert_allclose(layer(step, adapters)[:, 0], layer(prompt, adapters)[:, 0], rtol=1e-6, atol=1e-6)
        # ... without copying the rows' factors out of the stacks: the copies a decoding loop would hoist.
        gathers = lambda x: str(jax.make_jaxpr(lambda x: layer(x, adapters))(x)).count("gather")  # noqa: E731
        assert gathers(step) < gathers(prompt)
