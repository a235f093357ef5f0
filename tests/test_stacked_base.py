"""The `base-layers-stacked` change: the engine holds its decoder layers' frozen weights stacked by layer once, after
the base weights' load, and its programs read them instead of stacking every layer's weights at every call. The
same figures as before (losses, logprobs, gradients, greedy tokens and prompt logprobs), a stack that holds each
layer's weights in the dtype the scan computes in, and a training program that no longer stacks the frozen weights.
Upstream's JAX backend and model code in this process, on the tiny model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tx.tinker import types
from tx.tinker.backends import jax as backend

from tests.test_one_slot_gradient import rows_of
from tests.test_scanned_layers import build, loss_program, program_eqns
from txflow.config import TINY_MODEL
from txflow.upstream.skyrl_tx import models, ranks
from txflow.upstream.tiny_model import resolve_base_model


def engine(monkeypatch, stacked: bool):
    """Upstream's backend on the tiny model (float32) with the scanned layers, its base weights stacked or not, and
    a model "m" after one optimizer step (so that both LoRA factors get gradients)."""
    models.install()
    monkeypatch.setattr(backend, "load_safetensors", getattr(backend.load_safetensors, "upstream",
                                                             backend.load_safetensors))
    if stacked:
        ranks.base_layers_stacked()
    impl = backend.JaxBackendImpl(resolve_base_model(TINY_MODEL), backend.JaxBackendConfig(
        max_lora_adapters=2, max_lora_rank=4, train_micro_batch_size=4))
    assert hasattr(impl.model.model, models.STACKED) == stacked
    impl.create_model("m", types.LoraConfig(rank=4, alpha=8.0, seed=0))
    rows = [list(np.random.default_rng(i).integers(1, 200, 20 + i)) for i in range(4)]
    impl.forward_backward(rows_of(["m"] * 4, rows))
    impl.optim_step("m", types.OptimStepInput(adam_params=types.AdamParams(
        learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)))
    return impl


def figures(impl) -> dict:
    rows = [list(np.random.default_rng(10 + i).integers(1, 200, 18 + 2 * i)) for i in range(4)]
    impl.accumulated_grads = backend.AccumulatedGradients.create(impl.lora_params, impl.config.max_lora_adapters)
    out = impl.forward_backward(rows_of(["m"] * 4, rows))["r"].loss_fn_outputs
    impl.models["m"].loaded_checkpoint_id = "live"
    params = types.SamplingParams(temperature=0.0, max_tokens=4, seed=0)
    prompts = rows[:2]
    sampled = impl.sample(types.PreparedSampleBatch(
        all_prompts=prompts, all_sampling_params=[params] * 2, all_model_ids=["m"] * 2,
        all_checkpoint_ids=["live"] * 2, all_checkpoint_paths=[""] * 2, needs_prompt_logprobs=True,
        request_batch_slices=[(f"s{i}", "m", i, i + 1, True) for i in range(2)]))
    return {"logprobs": [o["logprobs"]["data"] for o in out], "losses": [o["elementwise_loss"]["data"] for o in out],
            "grads": [np.asarray(g) for g in jax.tree.leaves(impl.accumulated_grads.grad_sum)],
            "tokens": [list(sampled[f"s{i}"].sequences[0].tokens) for i in range(2)],
            "sampled_logprobs": [sampled[f"s{i}"].sequences[0].logprobs for i in range(2)],
            "prompt_logprobs": [sampled[f"s{i}"].prompt_logprobs for i in range(2)]}


def test_the_engine_with_its_base_layers_stacked_computes_what_it_computed(monkeypatch):
    before, after = figures(engine(monkeypatch, False)), figures(engine(monkeypatch, True))
    for key in ("logprobs", "losses", "sampled_logprobs", "prompt_logprobs"):
        for got, want in zip(after[key], before[key], strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=key)
    assert after["tokens"] == before["tokens"]
    assert len(after["grads"]) == len(before["grads"]) and any(g.any() for g in before["grads"])
    for got, want in zip(after["grads"], before["grads"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize(("dtype", "products"), [(jnp.float32, True), (jnp.bfloat16, False), (jnp.bfloat16, True)])
def test_the_stack_holds_each_layers_frozen_weights_in_the_dtype_the_scan_computes_in(dtype, products, monkeypatch):
    # `products`: on a CPU with AMX (`bfloat16-products-on-cpu`), which a bfloat16 model's projections multiply in
    monkeypatch.setattr(models, "bfloat16_products_on_this_cpu", lambda: products)
    model, mesh, _, _ = build(TINY_MODEL, dtype)
    with jax.set_mesh(mesh):
        assert models.stack_base_layers(model)
        assert not models.stack_base_layers(model)  # once
    held = getattr(model.model, models.STACKED)
    layers = [nnx.to_flat_state(nnx.state(layer)) for layer in model.model.layers]
    frozen = [{".".join(map(str, path)): v[...] for path, v in layer if "lora" not in str(path)} for layer in layers]
    assert set(held.keys()) == set(frozen[0]) and len(frozen[0]) >= 7  # the projections and the norms, no LoRA
    kernels = models.projection_kernels(model.model.layers[0])
    assert len(kernels) == 7 and kernels <= set(frozen[0])  # q, k, v, o, gate, up, down
    for name in frozen[0]:
        stacked = np.asarray(held[name][...])
        if dtype == jnp.bfloat16 and products and name in kernels:  # its bits, multiplied in bfloat16
            assert stacked.dtype == np.uint16
            want = np.stack([np.asarray(jax.lax.bitcast_convert_type(layer[name], jnp.uint16)) for layer in frozen])
            np.testing.assert_array_equal(stacked, want)
            continue
        assert stacked.dtype == np.float32  # on a CPU a bfloat16 model's layers compute in float32
        np.testing.assert_array_equal(stacked, np.stack([np.asarray(layer[name], np.float32) for layer in frozen]))


def stacks_of_frozen_weights(model) -> int:
    """How many arrays the training program stacks, by layer, in the shape of a layer's frozen weight."""
    program, lora, rest = loss_program(model)
    tokens = jnp.ones((4, 24), jnp.int32)
    jaxpr = jax.make_jaxpr(program)(lora, rest, tokens, tokens)
    count = len(model.model.layers)
    shapes = {(count, *v[...].shape) for path, v in nnx.to_flat_state(nnx.state(model.model.layers[0]))
              if "lora" not in str(path)}
    return sum(1 for eqn, _ in program_eqns(jaxpr.jaxpr) if eqn.primitive.name in ("stack", "concatenate")
               and tuple(eqn.outvars[0].aval.shape) in shapes)


def test_the_training_program_reads_the_stack_instead_of_stacking_the_layers():
    models.install()
    model, mesh, _, _ = build(TINY_MODEL)
    with jax.set_mesh(mesh):
        assert stacks_of_frozen_weights(model) >= 7  # every frozen weight stacked in the program
        models.stack_base_layers(model)
        assert stacks_of_frozen_weights(model) == 0
