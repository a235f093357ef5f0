"""The `one-slot-gradient` change: a forward_backward whose rows all train one model runs on that model's slot alone
and gives what upstream's program over every slot gives (logprobs, losses, the gradient sum of every slot, the
counts), packed or not, over several passes; a sampling batch of one adapter samples from its slot alone, the same
tokens and logprobs; batches of two models keep upstream's programs. Upstream's JAX backend in this process on the
tiny model, in float32, with LoRA on the embedding and the head too (`train_unembed`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tx.layers.lora import LoRAEmbed, LoRALinear
from tx.models import llama3, qwen3
from tx.tinker import types
from tx.tinker.backends import jax as backend

from tests.test_packing import model_pass, prompted_rows
from txflow.config import TINY_MODEL
from txflow.upstream.skyrl_tx import packing, ranks
from txflow.upstream.tiny_model import resolve_base_model


def rows_of(models: list[str], rows: list[list[int]]):
    batch = model_pass(rows, "importance_sampling")
    return batch.model_copy(update={"all_model_ids": models,
                                    "request_batch_slices": [("r", m, i, i + 1) for i, m in enumerate(models)]})


@pytest.fixture
def engine(monkeypatch):
    """Upstream's backend with `lora-per-example`, `packed-prefixes` and `one-slot-gradient` (each patched name
    upstream's again after the test); two models, "a" in slot 1 and "b" in slot 2 of 3, each after one optimizer
    step (so that both LoRA factors get gradients)."""
    for owner, name in ((backend.JaxBackendImpl, "_create_loss_and_grad_fn"), (backend.JaxBackendImpl, "_model_pass"),
                        (backend.JaxBackendImpl, "_micro_batch_size"), (backend.JaxBackendImpl, "sample"),
                        (backend.JaxBackendImpl, "load_sampler_weights"), (LoRAEmbed, "apply_lora"),
                        (LoRALinear, "apply_lora"), (llama3, "dot_product_attention"),
                        (qwen3, "dot_product_attention")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    ranks.lora_computes_each_examples_adapter()
    packing.model_passes_pack_shared_prefixes()
    ranks.one_slot_gradient()
    impl = backend.JaxBackendImpl(resolve_base_model(TINY_MODEL), backend.JaxBackendConfig(
        max_lora_adapters=3, max_lora_rank=4, train_micro_batch_size=4))
    adam = types.OptimStepInput(adam_params=types.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8,
                                                             weight_decay=0.0))
    rows = [list(np.random.default_rng(i).integers(1, 200, 20)) for i in range(2)]
    for model in ("a", "b"):
        impl.create_model(model, types.LoraConfig(rank=4, alpha=8.0, seed=0, train_unembed=True))
        impl.forward_backward(rows_of([model] * 2, rows))
        impl.optim_step(model, adam)
    return impl


def figures(impl, batches, one_slot: bool, monkeypatch) -> dict:
    """What the batches' forward_backwards give, one after another into a fresh accumulator, on the model's slot
    alone or (upstream's) over every slot; and how many passes ran on one slot."""
    taken = []
    with monkeypatch.context() as patch:
        patch.setattr(ranks, "slot_view", lambda *args, view=ranks.slot_view: (taken.append(1), view(*args))[1])
        if not one_slot:  # what keeps upstream's programs (LoRA experts, say) said of this model
            patch.setattr(ranks, "views_serve", lambda engine: False)
        impl.accumulated_grads = backend.AccumulatedGradients.create(impl.lora_params, impl.config.max_lora_adapters)
        outputs = [o for batch in batches for o in impl.forward_backward(batch).values()]
    return {"logprobs": [o["logprobs"]["data"] for out in outputs for o in out.loss_fn_outputs],
            "losses": [o["elementwise_loss"]["data"] for out in outputs for o in out.loss_fn_outputs],
            "grads": {jax.tree_util.keystr(path): np.asarray(g) for path, g in
                      jax.tree_util.tree_leaves_with_path(impl.accumulated_grads.grad_sum)},
            "counts": list(np.asarray(impl.accumulated_grads.counts)), "one_slot_passes": len(taken)}


def sampled(impl, models: list[str], one_slot: bool, monkeypatch) -> dict:
    """Greedy samples of 4 tokens of a prompt for each of `models` (their live weights), with the prompts' logprobs;
    on the batch's slot alone or (upstream's) over every slot."""
    taken = []
    prompts = [list(np.random.default_rng(30 + i).integers(1, 200, 12 + i)) for i in range(len(models))]
    for model in set(models) - {""}:
        impl.models[model].loaded_checkpoint_id = "live"
    params = types.SamplingParams(temperature=0.0, max_tokens=4, seed=0)
    batch = types.PreparedSampleBatch(
        all_prompts=prompts, all_sampling_params=[params] * len(prompts), all_model_ids=models,
        all_checkpoint_ids=["live" if m else "" for m in models], all_checkpoint_paths=[""] * len(prompts),
        needs_prompt_logprobs=True, request_batch_slices=[(f"r{i}", m, i, i + 1, True) for i, m in enumerate(models)])
    with monkeypatch.context() as patch:
        patch.setattr(ranks, "slot_view", lambda *args, view=ranks.slot_view: (taken.append(1), view(*args))[1])
        if not one_slot:
            patch.setattr(ranks, "views_serve", lambda engine: False)
        results = impl.sample(batch)
    assert {np.asarray(w).shape[0] for w in jax.tree.leaves(impl.lora_params)} == {3}  # every slot's weights back
    return {"tokens": [list(results[f"r{i}"].sequences[0].tokens) for i in range(len(models))],
            "logprobs": [results[f"r{i}"].sequences[0].logprobs for i in range(len(models))],
            "prompt_logprobs": [results[f"r{i}"].prompt_logprobs for i in range(len(models))],
            "views": len(taken)}


def assert_same(got: dict, want: dict) -> None:
    for key in ("logprobs", "losses"):
        for g, w in zip(got[key], want[key], strict=True):
            np.testing.assert_allclose(g, w, rtol=0, atol=2e-6)
    assert got["grads"].keys() == want["grads"].keys()
    for name, w in want["grads"].items():
        np.testing.assert_allclose(got["grads"][name], w, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(w).max())),
                                   err_msg=name)
    assert got["counts"] == want["counts"]


def test_one_models_rows_train_its_slot_alone_and_give_upstreams_figures(engine, monkeypatch):
    unrelated = [list(np.random.default_rng(10 + i).integers(1, 200, 20 + i)) for i in range(4)]
    shared = prompted_rows(2, 2, 5, shots=20)  # packed: one row
    batches = [rows_of(["a"] * 4, unrelated), rows_of(["a"] * 4, shared)]
    assert packing.plan_for([np.asarray(r) for r in shared], [1] * 4, 48) is not None
    alone, upstream = figures(engine, batches, True, monkeypatch), figures(engine, batches, False, monkeypatch)
    assert (alone["one_slot_passes"], upstream["one_slot_passes"]) == (2, 0)
    assert_same(alone, upstream)
    assert alone["counts"] == [0, 8, 0]
    assert any("embed_tokens" in name for name in alone["grads"])  # the embedding's LoRA is among them
    for name, grad in alone["grads"].items():  # slot 1's gradient only, and every factor has one
        assert np.abs(grad[1]).sum() > 0, name
        assert not grad[0].any() and not grad[2].any(), name


def test_rows_of_two_models_keep_upstreams_program(engine, monkeypatch):
    rows = [list(np.random.default_rng(20 + i).integers(1, 200, 24)) for i in range(4)]
    batches = [rows_of(["a", "b", "a", "b"], rows)]
    mixed, upstream = figures(engine, batches, True, monkeypatch), figures(engine, batches, False, monkeypatch)
    assert mixed["one_slot_passes"] == 0
    assert_same(mixed, upstream)
    assert mixed["counts"] == [0, 2, 2]
    assert all(np.abs(grad[1]).sum() > 0 and np.abs(grad[2]).sum() > 0 for grad in mixed["grads"].values())


def forwarded(impl, batch, one_slot: bool, monkeypatch) -> dict:
    """What a forward of `batch` gives, on the model's slot alone or (upstream's) over every slot, and whether it
    left the accumulated gradients as they were (the same arrays)."""
    taken = []
    with monkeypatch.context() as patch:
        patch.setattr(ranks, "slot_view", lambda *args, view=ranks.slot_view: (taken.append(1), view(*args))[1])
        if not one_slot:
            patch.setattr(ranks, "views_serve", lambda engine: False)
        before = jax.tree.leaves(impl.accumulated_grads)
        outputs = list(impl.forward(batch).values())
        after = jax.tree.leaves(impl.accumulated_grads)
    return {"logprobs": [o["logprobs"]["data"] for out in outputs for o in out.loss_fn_outputs],
            "losses": [o["elementwise_loss"]["data"] for out in outputs for o in out.loss_fn_outputs],
            "views": len(taken), "kept": all(a is b for a, b in zip(before, after, strict=True)),
            "accumulated": [np.asarray(a) for a in after]}


def test_a_forward_of_one_models_rows_runs_on_its_slot_alone_and_gives_upstreams_figures(engine, monkeypatch):
    rows = [list(np.random.default_rng(40 + i).integers(1, 200, 18 + i)) for i in range(3)]
    figures(engine, [rows_of(["a"] * 3, rows)], True, monkeypatch)  # a gradient pending in slot 1
    pending = [np.asarray(a) for a in jax.tree.leaves(engine.accumulated_grads)]
    alone = forwarded(engine, rows_of(["a"] * 3, rows), True, monkeypatch)
    upstream = forwarded(engine, rows_of(["a"] * 3, rows), False, monkeypatch)
    assert (alone["views"], upstream["views"]) == (1, 0)
    assert packing.installed_and_packs(engine)  # the one-slot program wraps the packing one; it still packs
    for key in ("logprobs", "losses"):
        for got, want in zip(alone[key], upstream[key], strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    assert alone["kept"]  # no copy of every slot's gradients, and the pending one untouched
    for got, want in zip(upstream["accumulated"], pending, strict=True):
        np.testing.assert_array_equal(got, want)
    # "a" and "b" are alike so far: a step of "a" (the pending gradient) must show in its slot's figures alone
    engine.optim_step("a", types.OptimStepInput(adam_params=types.AdamParams(
        learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)))
    stepped, other = (forwarded(engine, rows_of([m] * 3, rows), True, monkeypatch) for m in ("a", "b"))
    assert (stepped["views"], other["views"]) == (1, 1)
    np.testing.assert_allclose(np.concatenate(other["logprobs"]), np.concatenate(alone["logprobs"]), rtol=0,
                               atol=2e-6)
    assert np.abs(np.concatenate(stepped["logprobs"]) - np.concatenate(alone["logprobs"])).max() > 1e-3


@pytest.mark.parametrize("models", [["a"] * 3, [""] * 2, ["a", "b", "a"]])
def test_a_sampling_batch_of_one_adapter_samples_from_its_slot_alone(engine, models, monkeypatch):
    alone, upstream = sampled(engine, models, True, monkeypatch), sampled(engine, models, False, monkeypatch)
    assert (alone["views"], upstream["views"]) == (int(len(set(models)) == 1), 0)
    assert alone["tokens"] == upstream["tokens"]
    for key in ("logprobs", "prompt_logprobs"):
        for got, want in zip(alone[key], upstream[key], strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    if models == ["a"] * 3:  # the adapter's own samples: its weights moved the base model's logprobs
        base = sampled(engine, [""] * 3, True, monkeypatch)
        assert not np.allclose(np.concatenate(base["prompt_logprobs"]), np.concatenate(alone["prompt_logprobs"]))


def test_upstreams_lora_layers_are_never_given_a_view(engine, monkeypatch):
    # With upstream's routing over every slot back in a layer (a test restoring it, say), a one-adapter batch keeps
    # every slot's weights: that routing cannot read a view of one.
    from tx.layers import lora

    monkeypatch.setattr(LoRALinear, "apply_lora", lora.LoRAMixin.apply_lora)
    upstream = sampled(engine, ["a"] * 2, True, monkeypatch)
    assert upstream["views"] == 0 and len(upstream["tokens"]) == 2
