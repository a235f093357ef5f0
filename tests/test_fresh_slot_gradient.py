"""The `fresh-slot-gradient` change: a model unloaded between its forward_backward and its optimizer step leaves
nothing in its slot for the next model there. Upstream's JAX backend in this process on the tiny model; the same
through a real shared cluster is in tests/test_shared_cluster_e2e.py."""

from __future__ import annotations

import numpy as np
import pytest
from tx.tinker import types
from tx.tinker.backends import jax as backend

from tests.test_one_slot_gradient import rows_of
from txflow.upstream.skyrl_tx import ranks
from txflow.upstream.tiny_model import resolve_base_model

ADAM = types.OptimStepInput(adam_params=types.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8,
                                                         weight_decay=0.0))
ROWS = [list(np.random.default_rng(i).integers(1, 200, 20)) for i in range(2)]
NEIGHBOURS = [list(np.random.default_rng(10 + i).integers(1, 200, 20)) for i in range(2)]


@pytest.fixture
def patched(monkeypatch):
    """`optimizer-own-slot`'s `create_model` (with `fresh-slot-gradient`); upstream's names again after the test."""
    for name in ("_create_loss_and_grad_fn", "create_model", "_extract_checkpoint_data", "_insert_checkpoint_data"):
        monkeypatch.setattr(backend.JaxBackendImpl, name, backend.JaxBackendImpl.__dict__[name])
    monkeypatch.setattr(backend.JaxBackendImpl, "new_optimizer", None, raising=False)
    ranks.optimizer_covers_its_own_slot()


def one_step(neighbour_left_a_gradient: bool) -> tuple[int, list[float]]:
    """A fresh engine; a neighbour's model, unloaded after a forward_backward (no step) if asked; then model "y":
    its slot, and its losses after one step on ROWS."""
    impl = backend.JaxBackendImpl(resolve_base_model("tiny"), backend.JaxBackendConfig(max_lora_adapters=3,
                                                                                       max_lora_rank=4))
    lora = types.LoraConfig(rank=4, alpha=8.0, seed=0)
    if neighbour_left_a_gradient:
        impl.create_model("neighbour", lora)
        impl.forward_backward(rows_of(["neighbour"] * 2, NEIGHBOURS))
        impl.delete_model("neighbour")
    impl.create_model("y", lora)
    impl.forward_backward(rows_of(["y"] * 2, ROWS))
    impl.optim_step("y", ADAM)
    after = impl.forward_backward(rows_of(["y"] * 2, ROWS))
    losses = [float(np.sum(o["elementwise_loss"]["data"])) for out in after.values() for o in out.loss_fn_outputs]
    return impl.models["y"].adapter_index, losses


def test_a_model_in_a_slot_its_last_model_left_a_gradient_in_trains_as_on_a_fresh_engine(patched):
    fresh_slot, fresh = one_step(False)
    slot, losses = one_step(True)
    assert slot == fresh_slot == 1  # the neighbour's slot
    assert losses == fresh
