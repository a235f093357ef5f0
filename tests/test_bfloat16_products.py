"""The `bfloat16-products-on-cpu` change: on a CPU with bfloat16 dot instructions (AMX, AVX-512 BF16) a bfloat16
model's projections and tied head multiply bfloat16 operands into float32 results, forward and backward; the layers'
kernels go through the scan as their bits, so that no program holds a float32 copy of them; the figures stay those
of the layers computed in float32 (`scan-in-float32-on-cpu`) up to the rounding of each product's operands to
bfloat16, as a bfloat16 model's are. Each test sets whether the CPU multiplies in bfloat16, so that they hold on any
CPU."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tx.tinker.types import SamplingParams
from tx.utils.generator import GeneratorMixin

from tests.test_scanned_layers import ROWS, build, loss_program
from txflow.config import TINY_MODEL
from txflow.upstream.skyrl_tx import models


def test_the_cpus_that_multiply_bfloat16_are_those_with_its_dot_instructions():
    flags = "flags\t\t: fpu sse2 avx2 avx512f avx512bw {} xsave\n"
    assert models.bfloat16_dot_instructions(flags.format("avx512_bf16 amx_bf16 amx_tile")) == "amx_bf16"  # Intel SPR
    assert models.bfloat16_dot_instructions(flags.format("avx512_bf16")) == "avx512_bf16"  # AMD Zen 4, Cooper Lake
    assert models.bfloat16_dot_instructions(flags.format("avx512_vnni")) is None
    assert models.bfloat16_dot_instructions(flags.format("amx_tile avx512_fp16")) is None
    assert "amx_bf16" in models.products_note("amx_bf16") and "float32" in models.products_note(None)


def rounded(x) -> np.ndarray:
    """`x` rounded to bfloat16, in float64."""
    return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("contract", [0, 1])
def test_a_product_and_its_gradients_multiply_bfloat16_operands_into_float32(contract):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (3, 5, 64))
    shape = (64, 48) if contract == 0 else (48, 64)  # a kernel (in x out), an embedding (vocabulary x hidden)
    weight = jax.random.normal(keys[1], shape).astype(jnp.bfloat16)
    cotangent = jax.random.normal(keys[2], (3, 5, 48))
    w = np.asarray(weight, np.float64) if contract == 0 else np.asarray(weight, np.float64).T

    out = models.bfloat16_product(x, weight, contract=contract)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), rounded(x) @ w, rtol=1e-5, atol=1e-5)
    bits = jax.lax.bitcast_convert_type(weight, jnp.uint16)
    np.testing.assert_array_equal(np.asarray(models.bfloat16_product(x, bits, contract=contract)), np.asarray(out))

    def loss(x, weight):
        return (models.bfloat16_product(x, weight, contract=contract) * cotangent).sum()

    dx, dw = jax.grad(loss, argnums=(0, 1))(x, weight)
    assert dx.dtype == jnp.float32 and dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(dx), rounded(cotangent) @ w.T, rtol=1e-5, atol=1e-5)
    want_dw = np.einsum("bti,bto->io", rounded(x), rounded(cotangent))
    np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw if contract == 0 else want_dw.T, rtol=1e-2,
                               atol=1e-2)
    # the bits of a frozen weight: the same gradient to x, none to the weight
    dx_bits = jax.grad(lambda x: (models.bfloat16_product(x, bits, contract=contract) * cotangent).sum())(x)
    np.testing.assert_array_equal(np.asarray(dx_bits), np.asarray(dx))


def figures(model, mesh, tokens, mask) -> dict:
    jax.clear_caches()  # whether the CPU multiplies in bfloat16 changed between calls
    program, lora, rest = loss_program(model)
    with jax.set_mesh(mesh):
        (loss, logprobs), grads = program(lora, rest, tokens, mask)
        text = program.lower(lora, rest, tokens, mask).as_text()
        params = [SamplingParams(temperature=0.0, max_tokens=6, seed=0) for _ in range(ROWS)]
        result = model.generate(tokens, mask, sampling_params=params, adapter_indices=jnp.ones(ROWS, jnp.int32),
                                prompt_logprobs=True)
    return {"loss": float(loss), "logprobs": np.asarray(logprobs, np.float64),
            "grads": [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)], "text": text,
            "prompt_logprobs": np.concatenate([np.asarray(p, np.float64) for p in result.prompt_logprobs])}


def products_into_float32(text: str) -> int:
    """How many dot products of a lowered program take bfloat16 operands into a float32 result."""
    count = 0
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            operands, result = line.split(" : ")[-1].split("->")
            count += "xbf16>" in operands and "xf32>" in result
    return count


@pytest.fixture
def bfloat16_model(monkeypatch):
    """The tiny model in bfloat16, its decoder stack holding its layers' frozen weights (as the engine's does), and
    a switch for whether this CPU multiplies in bfloat16."""

    def build_it(products: bool):
        monkeypatch.setattr(models, "bfloat16_products_on_this_cpu", lambda: products)
        models.install()
        model, mesh, tokens, mask = build(TINY_MODEL, dtype=jnp.bfloat16)
        with jax.set_mesh(mesh):
            models.stack_base_layers(model)
        return model, mesh, tokens, mask

    return build_it


def test_a_bfloat16_model_computes_with_bfloat16_products_what_its_widened_layers_compute(bfloat16_model):
    widened = figures(*bfloat16_model(False))
    products = figures(*bfloat16_model(True))
    print(f"loss {products['loss']:.6f} against {widened['loss']:.6f} widened; max |d logprob| "
          f"{np.abs(products['logprobs'] - widened['logprobs']).max():.4f} (training), "
          f"{np.abs(products['prompt_logprobs'] - widened['prompt_logprobs']).max():.4f} (prompt)")
    differences = [np.abs(got - want).sum() / np.abs(want).sum()
                   for got, want in zip(products["grads"], widened["grads"], strict=True) if np.abs(want).sum()]
    print(f"gradients' relative L1 differences: {min(differences):.2e} to {max(differences):.2e}")
    # What XLA is asked: each layer's 7 projections in bfloat16 into float32 (forward, and the backward's gradient to
    # their input), the head too, where the widened layers ask for none.
    assert products_into_float32(widened["text"]) == 0
    assert products_into_float32(products["text"]) >= 7 * 2
    # The same figures up to the rounding of the products' operands to bfloat16 (a bfloat16 model's logprobs are
    # themselves rounded to bfloat16: steps of 1/32 at these magnitudes)
    assert abs(products["loss"] - widened["loss"]) <= 2e-3 * abs(widened["loss"])
    np.testing.assert_allclose(products["logprobs"], widened["logprobs"], rtol=0, atol=0.07)
    np.testing.assert_allclose(products["prompt_logprobs"], widened["prompt_logprobs"], rtol=0, atol=0.07)
    assert len(products["grads"]) == len(widened["grads"])
    for got, want in zip(products["grads"], widened["grads"], strict=True):
        if np.abs(want).sum():
            assert np.abs(got - want).sum() <= 0.02 * np.abs(want).sum()  # measured: 0.3-0.5%


def float32_arrays(text: str) -> set[tuple[int, ...]]:
    """The shapes of every float32 value a compiled program's text names."""
    return {tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\bf32\[([0-9,]*)\]", text)}


def kernel_shapes(model) -> set[tuple[int, ...]]:
    layer = model.model.layers[0]
    shapes = set()
    for name in models.projection_kernels(layer):
        module = layer
        for part in name.split(".")[:-1]:
            module = getattr(module, part)
        shapes.add(tuple(module.kernel[...].shape))
    return shapes


@pytest.mark.parametrize("products", [False, True])
def test_no_program_holds_a_float32_copy_of_a_kernel_where_the_cpu_multiplies_bfloat16(bfloat16_model, products,
                                                                                      monkeypatch):
    # The prompt logprobs' chunks of hidden states (chunks x positions x hidden, in float32) must not take a kernel
    # stack's shape: 128 positions of the tiny model's 64 would be its down projection's (layers x 128 x 64).
    monkeypatch.setattr(models, "LOGPROBS_CHUNK", 96)
    model, mesh, tokens, mask = bfloat16_model(products)
    jax.clear_caches()
    layers = len(model.model.layers)
    kernels = kernel_shapes(model)
    program, lora, rest = loss_program(model)
    sampling = GeneratorMixin._prefill_and_decode
    with jax.set_mesh(mesh):
        train = program.lower(lora, rest, tokens, mask).compile().as_text()
        sample = sampling.in_chunks.lower(
            model, tokens, mask, 64, 6, jnp.ones(ROWS, jnp.int32), jnp.zeros(ROWS),
            jax.random.split(jax.random.key(0), ROWS), jnp.full((ROWS, 1), -1, jnp.int32),
            jnp.zeros(ROWS, jnp.int32), jnp.ones(ROWS), 0, False, prompt_logprobs=True).compile().as_text()
    stacks = {(layers, *shape) for shape in kernels}
    print(f"float32 kernel stacks in training: {stacks & float32_arrays(train)}; float32 kernels in sampling: "
          f"{(kernels | stacks) & float32_arrays(sample)}")
    if products:
        assert not stacks & float32_arrays(train)
        assert not (kernels | stacks) & float32_arrays(sample)  # neither the prefill's stack nor the decoding loop's
    else:  # the widened layers: the stack in float32 (held so), and each layer's kernels widened for decoding
        assert stacks & float32_arrays(train)
        assert kernels & float32_arrays(sample)


def test_a_bfloat16_embeddings_rows_are_taken_as_they_are_without_a_float32_copy():
    # `embedding-rows-as-bits`
    models.install()
    model, mesh, tokens, _ = build(TINY_MODEL, dtype=jnp.bfloat16)
    embed = model.model.embed_tokens
    shape = tuple(embed.embedding[...].shape)
    adapters = jnp.ones(ROWS, jnp.int32)
    with jax.set_mesh(mesh):
        ours = jax.jit(lambda t: embed(t, adapter_indices=adapters))
        upstream = jax.jit(lambda t: type(embed).__call__.upstream(embed, t, adapter_indices=adapters))
        assert np.asarray(ours(tokens)).tobytes() == np.asarray(upstream(tokens)).tobytes()
        assert shape not in float32_arrays(ours.lower(tokens).compile().as_text())
        assert shape in float32_arrays(upstream.lower(tokens).compile().as_text())  # what it spares
