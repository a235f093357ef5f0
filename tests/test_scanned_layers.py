"""The `tied-head-from-arguments`, `scanned-layers` and `scan-in-float32-on-cpu` changes: the decoder layers under a
scan compute what upstream's loop computes (losses, gradients, logprobs, greedy tokens, in float32, on the tiny Qwen3
model and on SmolLM2-135M), a bfloat16 model's layers compute in float32 on a CPU, and no program holds the model's
weights as constants."""

from __future__ import annotations

import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from transformers import AutoConfig
from tx.layers.lora import init_lora_adapter
from tx.models.configs import ModelConfig
from tx.models.llama3 import Llama3ForCausalLM, Llama3Model
from tx.models.qwen3 import Qwen3ForCausalLM, Qwen3Model
from tx.tinker.types import LoraConfig, SamplingParams
from tx.utils.generator import GeneratorMixin
from tx.utils.models import get_model_class, load_safetensors

from txflow.config import SMOLLM2_MODEL, TINY_MODEL
from txflow.upstream.skyrl_tx import models
from txflow.upstream.tiny_model import resolve_base_model

ROWS, LENGTH = 4, 24


@pytest.fixture
def upstream_model_code(monkeypatch):
    """Upstream's model classes as they were, restored after the test whatever it installed."""
    for model_class in (Llama3Model, Qwen3Model):
        monkeypatch.setattr(model_class, "__call__", getattr(model_class.__call__, "upstream", model_class.__call__))
    for model_class in (Llama3ForCausalLM, Qwen3ForCausalLM):
        monkeypatch.setattr(model_class, "get_lm_head", getattr(model_class.get_lm_head, "upstream",
                                                                  model_class.get_lm_head))
    sampling = GeneratorMixin._prefill_and_decode
    monkeypatch.setattr(GeneratorMixin, "_prefill_and_decode", staticmethod(getattr(sampling, "upstream", sampling)))


def build(name: str, dtype=jnp.float32):
    """The named model in `dtype` (float32 unless given) with a trained-looking adapter in slot 1 (its B not zero,
    so that both LoRA factors get gradients) and a batch of token rows of unequal lengths."""
    path = resolve_base_model(name)
    config = ModelConfig(AutoConfig.from_pretrained(path), max_lora_adapters=2, max_lora_rank=8,
                         shard_attention_heads=True, loss_chunk_size=1024, gradient_checkpointing=False)
    mesh = jax.make_mesh((1, 1, 1), ("fsdp", "ep", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    with jax.set_mesh(mesh), nnx.use_eager_sharding(True):
        model = get_model_class(config)(config, dtype=dtype, rngs=nnx.Rngs(0))
        load_safetensors(path, config, model)
        init_lora_adapter(model, 1, LoraConfig(rank=8, alpha=16.0, seed=3))
    keys = iter(jax.random.split(jax.random.key(7), 1000))
    for path_, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path_[-1] == "lora_B":
            variable[...] = variable[...].at[1].set(
                (0.02 * jax.random.normal(next(keys), variable.shape[1:])).astype(variable.dtype))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, min(config.vocab_size, 5000), (ROWS, LENGTH)), dtype=jnp.int32)
    mask = jnp.asarray([[1] * (LENGTH - 3 * i) + [0] * (3 * i) for i in range(ROWS)], dtype=jnp.int32)
    return model, mesh, tokens, mask


def loss_program(model):
    """The training program's shape: the weights as arguments, the loss and its gradient to the LoRA weights,
    the per-token logprobs beside."""
    graphdef, lora, rest = nnx.split(model, model.is_lora_param, ...)
    adapters = jnp.ones((ROWS,), dtype=jnp.int32)

    def loss(lora, rest, tokens, mask):
        merged = nnx.merge(graphdef, lora, rest)
        hidden = merged(tokens, attention_mask=mask, adapter_indices=adapters).last_hidden_state
        targets = jnp.roll(tokens, -1, axis=1)
        logprobs = merged.compute_logprobs(hidden, targets, adapters)
        return -(logprobs * mask).sum(), logprobs

    return jax.jit(jax.value_and_grad(loss, has_aux=True)), lora, rest


def figures(model, mesh, tokens, mask, sample: bool):
    jax.clear_caches()  # the class's code changed between calls; a cached trace would hide it
    program, lora, rest = loss_program(model)
    with jax.set_mesh(mesh):
        (loss, logprobs), grads = program(lora, rest, tokens, mask)
        out = {"loss": np.asarray(loss), "logprobs": np.asarray(logprobs),
               "grads": [np.asarray(g) for g in jax.tree.leaves(grads)]}
        if sample:
            params = [SamplingParams(temperature=0.0, max_tokens=6, seed=0) for _ in range(ROWS)]
            result = model.generate(tokens, mask, sampling_params=params, adapter_indices=jnp.ones(ROWS, jnp.int32),
                                    prompt_logprobs=True)
            out.update(greedy=result.generated_ids, sampled_logprobs=np.asarray(result.logprobs),
                       prompt_logprobs=[np.asarray(p) for p in result.prompt_logprobs])
    return out


def assert_equal_figures(loop: dict, scan: dict) -> None:
    np.testing.assert_allclose(scan["loss"], loop["loss"], rtol=1e-6)
    np.testing.assert_allclose(scan["logprobs"], loop["logprobs"], rtol=0, atol=1e-6)
    assert len(scan["grads"]) == len(loop["grads"]) and sum(np.abs(g).sum() > 0 for g in loop["grads"]) > 0
    for got, want in zip(scan["grads"], loop["grads"]):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * max(1.0, float(np.abs(want).max())))
    if "greedy" in loop:
        assert scan["greedy"] == loop["greedy"]
        np.testing.assert_allclose(scan["sampled_logprobs"], loop["sampled_logprobs"], rtol=0, atol=1e-6)
        for got, want in zip(scan["prompt_logprobs"], loop["prompt_logprobs"]):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("name", "sample"), [(TINY_MODEL, True), (SMOLLM2_MODEL, False)])
def test_the_scanned_layers_compute_what_upstreams_loop_computes(name, sample, upstream_model_code):
    model, mesh, tokens, mask = build(name)
    loop = figures(model, mesh, tokens, mask, sample)
    models.install()
    assert Llama3Model.__call__.upstream is not None and Qwen3Model.__call__.upstream is not None
    scan = figures(model, mesh, tokens, mask, sample)
    assert_equal_figures(loop, scan)


def bfloat16_dots(text: str) -> int:
    """How many dot products of a lowered program's StableHLO text take bfloat16 operands."""
    return sum("xbf16>" in line.split("->")[0].split(" : ")[-1]
               for line in text.splitlines() if "stablehlo.dot_general" in line)


def test_a_bfloat16_models_layers_compute_in_float32_under_the_scan_on_a_cpu(upstream_model_code, monkeypatch):
    # `scan-in-float32-on-cpu`, on a CPU without AMX (with AMX the projections multiply in bfloat16:
    # tests/test_bfloat16_products.py). What XLA is asked: the training program of the bfloat16 model keeps
    # bfloat16 dots only outside its layers (the embedding's LoRA, the head), and its gradients stay bfloat16 as the
    # state is.
    monkeypatch.setattr(models, "bfloat16_products_on_this_cpu", lambda: False)
    model, mesh, tokens, mask = build(TINY_MODEL, dtype=jnp.bfloat16)
    models.install()

    def lowered():
        jax.clear_caches()
        program, lora, rest = loss_program(model)
        with jax.set_mesh(mesh):
            return program.lower(lora, rest, tokens, mask).as_text(), program(lora, rest, tokens, mask)[1]

    widened, grads = lowered()
    with monkeypatch.context() as undo:
        undo.setattr(models, "widened", lambda weights, kernels=(): None)
        narrow, _ = lowered()
    print(f"bfloat16 dots: {bfloat16_dots(narrow)} with the layers in bfloat16, {bfloat16_dots(widened)} widened")
    assert 0 < bfloat16_dots(widened) and bfloat16_dots(widened) * 3 < bfloat16_dots(narrow)
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
    # Same figures as without it in float32: test_the_scanned_layers_compute_what_upstreams_loop_computes.


def program_eqns(jaxpr, in_scan: bool = False):
    """Every equation of a jaxpr and of the jaxprs inside it, each with whether it sits inside a scan."""
    for eqn in jaxpr.eqns:
        yield eqn, in_scan
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
                if isinstance(sub, jax.extend.core.Jaxpr):
                    yield from program_eqns(sub, in_scan or eqn.primitive.name == "scan")


def rematerialised_layers(model, mesh, tokens, mask) -> int:
    """How many rematerialised (checkpointed) functions the training program's scans hold."""
    jax.clear_caches()
    program, lora, rest = loss_program(model)
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(program)(lora, rest, tokens, mask)
    return sum(1 for eqn, in_scan in program_eqns(jaxpr.jaxpr)
               if in_scan and eqn.primitive.name in ("checkpoint", "remat", "remat2"))


def test_a_bfloat16_models_widened_layers_keep_only_their_dots_for_the_backward():
    # `widened-layers-keep-their-dots`: under the scan a widened layer saves its projections' outputs and computes
    # the rest again; a float32 model's layers keep what upstream's keep (their figures to the last bits above).
    models.install()
    assert rematerialised_layers(*build(TINY_MODEL, dtype=jnp.bfloat16)) >= 1
    assert rematerialised_layers(*build(TINY_MODEL)) == 0


def constants_of(text: str) -> list[int]:
    """The element count of every constant in a lowered program's StableHLO text."""
    counts = []
    for shape in re.findall(r"stablehlo\.constant dense<[^\n]*?> : tensor<([0-9x]*)[a-z]+[0-9]*>", text):
        counts.append(int(np.prod([int(d) for d in shape.split("x") if d])) if shape else 1)
    return counts


def test_no_program_holds_the_tied_embedding_as_a_constant(upstream_model_code):
    model, mesh, tokens, mask = build(SMOLLM2_MODEL)
    embedding = model.config.vocab_size * model.config.hidden_size

    def largest_constants() -> tuple[int, int]:
        jax.clear_caches()
        program, lora, rest = loss_program(model)
        with jax.set_mesh(mesh):
            train = program.lower(lora, rest, tokens, mask).as_text()
            # `prefill-once-per-prompt` calls upstream's program when no prompt repeats
            program_of = GeneratorMixin._prefill_and_decode
            sample = getattr(program_of, "upstream", program_of).lower(
                model, tokens, mask, 64, 6, jnp.ones(ROWS, jnp.int32), jnp.zeros(ROWS), jax.random.split(
                    jax.random.key(0), ROWS), jnp.full((ROWS, 1), -1, jnp.int32), jnp.zeros(ROWS, jnp.int32),
                jnp.ones(ROWS), 0, False).as_text()
        return max(constants_of(train)), max(constants_of(sample))

    assert max(largest_constants()) >= embedding  # the check sees upstream's folded head
    models.install()
    train, sample = largest_constants()
    assert train < 10_000 and sample < 10_000, (train, sample)


def test_a_decode_step_keeps_upstreams_loop_and_a_prefill_runs_under_the_scan():
    """A decode step (one token per row, with a KV cache) is too little work to pay for copying each layer's
    weights out of the stack, which XLA on CPU does inside a scan: it runs upstream's loop."""
    model, mesh, tokens, mask = build(TINY_MODEL)
    models.install()
    adapters = jnp.ones(ROWS, jnp.int32)

    def primitives(fn, *args) -> set[str]:
        jaxpr = jax.make_jaxpr(fn)(*args)
        return {eqn.primitive.name for eqn in jaxpr.eqns}

    with jax.set_mesh(mesh):
        prefill = model(tokens, attention_mask=mask, adapter_indices=adapters)
        assert "scan" in primitives(
            lambda t, m: model(t, attention_mask=m, adapter_indices=adapters).last_hidden_state, tokens, mask)
        cache = prefill.kv_cache.pad_to_length(LENGTH + 8)
        step_mask = jnp.pad(mask, ((0, 0), (0, 8)))
        positions = mask.sum(axis=1, keepdims=True)

        def decode(token):
            return model(token, attention_mask=step_mask, positions=positions, kv_cache=cache,
                         adapter_indices=adapters).last_hidden_state

        assert "scan" not in primitives(decode, tokens[:, :1])
