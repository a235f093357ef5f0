"""txflow's state checkpoint I/O in the SkyRL-tx backend (txflow.upstream.skyrl_tx.checkpoint_io, the
`rank0-checkpoint-io` and `adapter-state-program` changes), in one process on the tiny model: exact round trip, one
file, checkpoints of upstream's Orbax format still load, clear errors, an adapter's slices those of upstream. The
multi-process, no-shared-disk path runs end to end in tests/test_s3_e2e.py. Also, on the same engine, a model's
optimizer step writes only its own slot (`optimizer-own-slot`; through the real cluster in
tests/test_shared_cluster_e2e.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from tx.tinker.backends import jax as jax_backend
from tx.utils import models

from txflow.upstream.skyrl_tx import checkpoint_io, layout, ranks
from txflow.upstream.tiny_model import resolve_base_model

pytestmark = [pytest.mark.together]


@pytest.fixture(scope="module")
def backend():
    from tx.tinker.backends.jax import JaxBackendConfig, JaxBackendImpl

    originals = {n: JaxBackendImpl.__dict__[n]
                 for n in ("save_checkpoint", "load_checkpoint", "load_sampler_checkpoint")}
    upstream_save = originals["save_checkpoint"]
    slicing = {(module, name): getattr(module, name) for module in (models, jax_backend)
               for name in ("extract_adapter_state", "insert_adapter_state")}
    upstream_optimizer = JaxBackendImpl.__dict__["_create_loss_and_grad_fn"]
    checkpoint_io.install_checkpoint_io()
    checkpoint_io.adapter_state_in_one_program()
    ranks.optimizer_steps_only_its_own_slot()
    try:
        impl = JaxBackendImpl(resolve_base_model("tiny"), JaxBackendConfig(max_lora_adapters=16, max_lora_rank=8))
        impl.upstream_save = lambda path, model_id: upstream_save(impl, path, model_id)
        impl.upstream_slicing = {name: function for (_, name), function in slicing.items()}
        yield impl
    finally:
        for name, function in originals.items():
            setattr(JaxBackendImpl, name, function)
        for (module, name), function in slicing.items():
            setattr(module, name, function)
        JaxBackendImpl._create_loss_and_grad_fn = upstream_optimizer


def new_model(backend, model_id: str, rank: int = 4, seed: int = 0) -> None:
    from tx.tinker import types

    backend.create_model(model_id, types.LoraConfig(rank=rank, alpha=8.0, seed=seed))


def state_of(backend, model_id: str) -> list[np.ndarray]:
    data = backend._extract_checkpoint_data(model_id)
    return [np.asarray(x) for x in jax.tree.leaves({"w": data["lora_weights"], "o": data["optimizer_state"]})]


def assert_same_state(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def test_state_round_trip_is_exact_and_one_file(backend, tmp_path):
    new_model(backend, "saved", seed=1)
    new_model(backend, "restored", seed=2)
    saved = state_of(backend, "saved")
    assert not all(np.array_equal(x, y) for x, y in zip(saved, state_of(backend, "restored")))  # seeds differ

    backend.save_checkpoint(tmp_path / "step-000001.tar.gz", "saved")
    assert [p.name for p in (tmp_path / "step-000001.tar.gz").iterdir()] == [layout.STATE_FILE]
    backend.load_checkpoint(tmp_path / "step-000001.tar.gz", "restored")

    assert_same_state(state_of(backend, "restored"), saved)


def test_a_checkpoint_in_upstreams_orbax_format_still_loads(backend, tmp_path):
    new_model(backend, "orbax-saved", seed=3)
    new_model(backend, "orbax-restored", seed=4)
    backend.upstream_save(tmp_path / "old.tar.gz", "orbax-saved")
    assert (tmp_path / "old.tar.gz" / checkpoint_io.UPSTREAM_STATE_DIR).is_dir()

    backend.load_checkpoint(tmp_path / "old.tar.gz", "orbax-restored")

    assert_same_state(state_of(backend, "orbax-restored"), state_of(backend, "orbax-saved"))


def test_missing_checkpoint_and_other_rank_fail_clearly(backend, tmp_path):
    new_model(backend, "rank8", rank=8)
    with pytest.raises(FileNotFoundError, match="Training checkpoint not found"):
        backend.load_checkpoint(tmp_path / "nothing.tar.gz", "rank8")
    new_model(backend, "rank4", rank=4)
    backend.save_checkpoint(tmp_path / "r4.tar.gz", "rank4")
    before = state_of(backend, "rank8")
    with pytest.raises(ValueError, match="LoRA rank 4 in the checkpoint, 8 in the model"):
        backend.load_checkpoint(tmp_path / "r4.tar.gz", "rank8")
    assert_same_state(state_of(backend, "rank8"), before)  # nothing was half-loaded


def optimizer_of(backend, model_id: str) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(backend._extract_checkpoint_data(model_id)["optimizer_state"])]


def test_a_state_load_restores_the_optimizer_only_when_asked(backend, tmp_path):
    # The `load-optimizer-flag` change: Tinker's load_state starts the optimizer afresh, load_state_with_optimizer
    # restores it.
    new_model(backend, "trained", seed=5)
    new_model(backend, "never-stepped", seed=6)
    fresh = optimizer_of(backend, "never-stepped")
    data = backend._extract_checkpoint_data("trained")
    moved = jax.tree.map(lambda x: (x + 1).astype(x.dtype), {"lora_weights": data["lora_weights"],
                                             "optimizer_state": data["optimizer_state"]})
    backend._insert_checkpoint_data("trained", {**moved, "lora_config": data["lora_config"]})  # as if trained
    trained = state_of(backend, "trained")
    assert not any(np.array_equal(a, b) for a, b in zip(optimizer_of(backend, "trained"), fresh))
    backend.save_checkpoint(tmp_path / "trained.tar.gz", "trained")

    new_model(backend, "with-optimizer", seed=7)
    backend.load_checkpoint(tmp_path / "trained.tar.gz", "with-optimizer", load_optimizer=True)
    assert_same_state(state_of(backend, "with-optimizer"), trained)

    new_model(backend, "weights-only", seed=8)
    backend.load_checkpoint(tmp_path / "trained.tar.gz", "weights-only", load_optimizer=False)
    weights = backend._extract_checkpoint_data("weights-only")["lora_weights"]
    assert_same_state([np.asarray(x) for x in jax.tree.leaves(weights)],
                      [np.asarray(x) for x in jax.tree.leaves(moved["lora_weights"])])
    assert_same_state(optimizer_of(backend, "weights-only"), fresh)
    # A model that trained before the load loses its moments too, not only a new one.
    backend.load_checkpoint(tmp_path / "trained.tar.gz", "with-optimizer", load_optimizer=False)
    assert_same_state(optimizer_of(backend, "with-optimizer"), fresh)


def test_an_adapters_state_is_sliced_and_put_back_as_upstream_does_in_any_slot(backend):
    # `adapter-state-program`: one program for every slot, the slot a traced argument, the same arrays as upstream's
    # program per slot.
    upstream_extract, upstream_insert = (backend.upstream_slicing[n] for n in ("extract_adapter_state",
                                                                              "insert_adapter_state"))
    new_model(backend, "slot-a", rank=8, seed=9)
    new_model(backend, "slot-b", rank=8, seed=10)
    for model_id in ("slot-a", "slot-b"):
        index = backend.models[model_id].adapter_index
        for state in (backend.lora_params, nnx.state(backend.optimizers[model_id])):
            assert_same_state(jax.tree.leaves(models.extract_adapter_state(index, state, 8)),
                              jax.tree.leaves(upstream_extract(index, state, 8)))
    a = backend.models["slot-a"].adapter_index
    everything = [np.asarray(x) for x in jax.tree.leaves(backend.lora_params)]
    moved = jax.tree.map(lambda x: (x + 1).astype(x.dtype), upstream_extract(a, backend.lora_params, 8))
    models.insert_adapter_state(a, backend.lora_params, moved, 8)
    assert_same_state(jax.tree.leaves(upstream_extract(a, backend.lora_params, 8)), jax.tree.leaves(moved))
    upstream_insert(a, backend.lora_params, upstream_extract(a, backend.lora_params, 8), 8)  # no-op by upstream
    after = [np.asarray(x) for x in jax.tree.leaves(backend.lora_params)]
    # Only slot a moved: every other slot (slot-b's included) is as it was.
    assert any(not np.array_equal(x[a], y[a]) for x, y in zip(everything, after))
    others = [i for i in range(backend.config.max_lora_adapters) if i != a]  # slots come first in every LoRA leaf
    assert all(np.array_equal(x[others], y[others]) for x, y in zip(everything, after))


def optimizer_step_of(impl, model_id: str, weight_decay: float) -> None:
    """One cross-entropy forward_backward on two rows, then AdamW at lr 0.1 with `weight_decay`."""
    from tx.tinker import types

    rows = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]]
    impl.forward_backward(types.PreparedModelPassBatch(
        all_input_ids=rows, all_targets=[r[1:] + [r[0]] for r in rows],
        all_token_weights=[[0.0] * 5 + [1.0] * 3 for _ in rows], all_sampling_logprobs=[[0.0] * 8 for _ in rows],
        all_advantages=[[0.0] * 8 for _ in rows], all_model_ids=[model_id] * 2,
        all_loss_fn_types=[types.LOSS_TYPES["cross_entropy"]] * 2, all_loss_fn_configs=[None] * 2,
        request_batch_slices=[("r", model_id, 0, 2)]))
    impl.optim_step(model_id, types.OptimStepInput(adam_params=types.AdamParams(
        learning_rate=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=weight_decay)))


def slot_of(impl, model_id: str) -> list[np.ndarray]:
    index = impl.models[model_id].adapter_index
    return [np.asarray(leaf)[index].copy() for leaf in jax.tree.leaves(impl.lora_params)]


def test_a_step_with_weight_decay_leaves_the_neighbours_adapter_as_it_was(backend):
    """Upstream's step shrank the neighbour's weights by lr * weight_decay (5% here) at each of my steps (the same
    test without the change fails so); here they stay bit for bit, and my own slot is updated."""
    new_model(backend, "mine", rank=8, seed=11)
    new_model(backend, "neighbour", rank=8, seed=12)
    # The neighbour's lora_B is no longer zero after a step of its own: its outputs depend on its lora_A.
    optimizer_step_of(backend, "neighbour", weight_decay=0.0)
    optimizer_step_of(backend, "mine", weight_decay=0.0)
    neighbour, mine = slot_of(backend, "neighbour"), slot_of(backend, "mine")
    optimizer_step_of(backend, "mine", weight_decay=0.5)

    assert all(np.array_equal(a, b) for a, b in zip(slot_of(backend, "neighbour"), neighbour))
    assert any(not np.array_equal(a, b) for a, b in zip(slot_of(backend, "mine"), mine))
    optimizer_step_of(backend, "neighbour", weight_decay=0.0)  # the neighbour still trains
    assert any(not np.array_equal(a, b) for a, b in zip(slot_of(backend, "neighbour"), neighbour))
