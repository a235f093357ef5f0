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
    upstream_optimizer = {n: JaxBackendImpl.__dict__[n] for n in (
        "_create_loss_and_grad_fn", "create_model", "_extract_checkpoint_data", "_insert_checkpoint_data")}
    checkpoint_io.install_checkpoint_io()
    checkpoint_io.adapter_state_in_one_program()
    ranks.optimizer_covers_its_own_slot()
    try:
        impl = JaxBackendImpl(resolve_base_model("tiny"), JaxBackendConfig(max_lora_adapters=20, max_lora_rank=8))
        impl.upstream_save = lambda path, model_id: upstream_save(impl, path, model_id)
        impl.upstream_slicing = {name: function for (_, name), function in slicing.items()}
        yield impl
    finally:
        for name, function in originals.items():
            setattr(JaxBackendImpl, name, function)
        for (module, name), function in slicing.items():
            setattr(module, name, function)
        for name, function in upstream_optimizer.items():
            setattr(JaxBackendImpl, name, function)
        del JaxBackendImpl.new_optimizer


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
        # The optimizer's state is a one-slot view (`optimizer-own-slot`): its slot index is 0.
        for state, at in ((backend.lora_params, index), (nnx.state(backend.optimizers[model_id]), 0)):
            assert_same_state(jax.tree.leaves(models.extract_adapter_state(at, state, 8)),
                              jax.tree.leaves(upstream_extract(at, state, 8)))
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


def optimizer_step_of(impl, model_id: str, weight_decay: float, optimize: bool = True) -> None:
    """One cross-entropy forward_backward on two rows, then (`optimize`) AdamW at lr 0.1 with `weight_decay`."""
    from tx.tinker import types

    rows = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]]
    impl.forward_backward(types.PreparedModelPassBatch(
        all_input_ids=rows, all_targets=[r[1:] + [r[0]] for r in rows],
        all_token_weights=[[0.0] * 5 + [1.0] * 3 for _ in rows], all_sampling_logprobs=[[0.0] * 8 for _ in rows],
        all_advantages=[[0.0] * 8 for _ in rows], all_model_ids=[model_id] * 2,
        all_loss_fn_types=[types.LOSS_TYPES["cross_entropy"]] * 2, all_loss_fn_configs=[None] * 2,
        request_batch_slices=[("r", model_id, 0, 2)]))
    if not optimize:
        return
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


def test_a_models_optimizer_holds_its_own_slot_and_steps_as_upstreams_over_every_slot(backend):
    """`optimizer-own-slot`: Adam's moments of one slot per model (upstream's `nnx.Optimizer` held every slot's), and
    a step equal to upstream's on the model's slot, AdamW's weight decay on: weights and both moments within 1e-6
    (the two programs fuse Adam's arithmetic differently: measured, at most one float32 rounding apart)."""
    import optax
    from tx.tinker import types

    new_model(backend, "exact", rank=8, seed=13)
    index = backend.models["exact"].adapter_index
    slots = backend.config.max_lora_adapters
    moments = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(backend.optimizers["exact"]))[0]
               if "lora_" in jax.tree_util.keystr(path)]
    assert moments and all(leaf.shape[0] == 1 for leaf in moments)
    weights = [leaf for leaf in jax.tree.leaves(backend.lora_params)]
    assert sum(m.size for m in moments) == 2 * sum(w.size for w in weights) // slots  # mu and nu of one slot
    adam = types.AdamParams(learning_rate=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.3)
    for _ in range(2):  # the second step from moments that are no longer zero
        optimizer_step_of(backend, "exact", weight_decay=0.0, optimize=False)
        grads, before = backend.accumulated_grads, nnx.as_pure(backend.lora_params)
        before_values = [np.asarray(leaf).copy() for leaf in jax.tree.leaves(before)]  # (the step donates them)
        # Upstream's step (its `compute_grads_and_update`), over every slot, from the same moments.
        with jax.set_mesh(backend.mesh):
            full = nnx.Optimizer(backend.model, optax.inject_hyperparams(optax.adamw)(learning_rate=0.0),
                                 wrt=backend.model.is_lora_param)
            mine = nnx.as_pure(nnx.state(backend.optimizers["exact"]))
            nnx.update(full, jax.tree.map(lambda f, m: f.at[index].set(m[0]) if f.ndim and f.shape[0] == slots
                                          else m, nnx.as_pure(nnx.state(full)), mine))
            hp = full.opt_state.hyperparams
            for name, value in (("learning_rate", 0.1), ("b1", 0.9), ("b2", 0.95), ("eps", 1e-8),
                                ("weight_decay", 0.3)):
                hp[name][...] = value

            @nnx.jit
            def upstream_step(lora_params, optimizer, grads, adapter_index):
                optimizer.update(lora_params, grads.get_mean(adapter_index))

            upstream_step(backend.lora_params, full, grads, jax.numpy.int32(index))
        expected = [np.asarray(leaf)[index].copy() for leaf in jax.tree.leaves(backend.lora_params)]
        expected_moments = [np.asarray(leaf)[index] for path, leaf in jax.tree_util.tree_flatten_with_path(
            nnx.state(full))[0] if "lora_" in jax.tree_util.keystr(path)]
        nnx.update(backend.lora_params, before)  # back to where the step started, then txflow's step
        backend.accumulated_grads = grads
        backend.optim_step("exact", types.OptimStepInput(adam_params=adam))
        assert_close(slot_of(backend, "exact"), expected)
        assert_close([np.asarray(leaf)[0] for path, leaf in jax.tree_util.tree_flatten_with_path(
            nnx.state(backend.optimizers["exact"]))[0] if "lora_" in jax.tree_util.keystr(path)], expected_moments)
        assert any(not np.array_equal(a, b[index]) for a, b in zip(expected, before_values))  # it moved


def assert_close(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b) and all(x.shape == y.shape for x, y in zip(a, b))
    worst = max(float(np.max(np.abs(x - y), initial=0.0)) for x, y in zip(a, b))
    print(f"max |difference| {worst:.3g}")
    assert worst <= 1e-6


def slot_step(accumulated_grads, lora_params, optimizer, adapter_index):
    """The step `optimizer-own-slot` made under nnx.jit, on flax's objects: the slot's mean gradient, upstream's
    `Optimizer.update` on a view of the slot's weights, the view written back, the slot's gradient sum reset."""
    def slot(w):  # the slot axis comes first in every LoRA weight; `adapter_index` is traced
        return jax.lax.dynamic_slice_in_dim(w, adapter_index, 1, axis=0)

    count = accumulated_grads.counts[adapter_index]
    view = jax.tree.map(slot, lora_params)
    optimizer.update(view, jax.tree.map(lambda g: slot(g) / count.astype(g.dtype), accumulated_grads.grad_sum))
    nnx.update(lora_params, jax.tree.map(
        lambda w, mine: jax.lax.dynamic_update_slice_in_dim(w, mine, adapter_index, axis=0),
        nnx.as_pure(lora_params), nnx.as_pure(view)))
    return accumulated_grads.reset_adapter(adapter_index)


def test_the_optimizer_step_in_one_flat_call_is_the_slot_step_bit_for_bit(backend):
    """`optimizer-flat-call`: the engine's step (`ranks.flat_optimizer_step`, one jitted program over lists of arrays)
    leaves every slot's weights, the optimizer's whole state (moments, step count, hyperparameters) and the gradient
    sums and counts exactly as `slot_step` under nnx.jit does (the step on flax's objects), twice in a row, and
    writes them into the same variables."""
    from tx.tinker import types

    new_model(backend, "flat", rank=8, seed=17)
    index = backend.models["flat"].adapter_index
    optimizer = backend.optimizers["flat"]
    weight_variables = jax.tree_util.tree_leaves(backend.lora_params, is_leaf=ranks.is_variable)
    adam = types.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

    def everything() -> list[np.ndarray]:
        return [np.asarray(x).copy() for x in jax.tree.leaves(nnx.as_pure(
            (backend.lora_params, nnx.state(optimizer), backend.accumulated_grads.grad_sum,
             backend.accumulated_grads.counts)))]

    for _ in range(2):  # the second step from moments that are no longer zero
        optimizer_step_of(backend, "flat", weight_decay=0.0, optimize=False)
        optimizer_step_of(backend, "flat", weight_decay=0.0, optimize=False)  # two passes: a mean of two
        grads, before = backend.accumulated_grads, everything()
        weights, state = nnx.as_pure(backend.lora_params), nnx.as_pure(nnx.state(optimizer))
        hp = optimizer.opt_state.hyperparams
        for name, value in (("learning_rate", 0.05), ("b1", 0.9), ("b2", 0.95), ("eps", 1e-8),
                            ("weight_decay", 0.1)):
            hp[name][...] = value
        with jax.set_mesh(backend.mesh):
            backend.accumulated_grads = nnx.jit(slot_step)(grads, backend.lora_params, optimizer,
                                                                 jax.numpy.int32(index))
        expected = everything()
        assert any(not np.array_equal(a, b) for a, b in zip(before, expected))  # it stepped
        nnx.update(backend.lora_params, weights)  # back to where the step started, then the engine's step
        nnx.update(optimizer, state)
        backend.accumulated_grads = grads
        assert all(np.array_equal(a, b) for a, b in zip(everything(), before))
        backend.optim_step("flat", types.OptimStepInput(adam_params=adam))
        assert_same_state(everything(), expected)
        now = jax.tree_util.tree_leaves(backend.lora_params, is_leaf=ranks.is_variable)
        assert len(now) == len(weight_variables) and all(a is b for a, b in zip(now, weight_variables))


def test_the_optimizer_steps_layer_by_layer_with_one_program_for_each_group_of_layers(backend, monkeypatch):
    """`optimizer-layer-by-layer`: the step runs one program per group of `LAYERS_A_PROGRAM` decoder layers, the same
    program for every group, and one for the weights outside the layers; each weight and each of its moments in
    exactly one group. One layer a group here (the tiny model has two). That the step's figures are those of one
    program over every weight, bit for bit, the test above holds."""
    monkeypatch.setattr(ranks, "LAYERS_A_PROGRAM", 1)
    ranks.layer_groups.cache_clear()
    new_model(backend, "layered", rank=8, seed=19)
    optimizer = backend.optimizers["layered"]
    program = ranks.layer_step_program(optimizer.tx)
    program.clear_cache()
    try:
        optimizer_step_of(backend, "layered", weight_decay=0.0)
        groups, nodes, _ = ranks.layer_groups(jax.tree_util.tree_structure(backend.lora_params),
                                              jax.tree_util.tree_structure(backend.accumulated_grads.grad_sum),
                                              jax.tree_util.tree_structure(optimizer.opt_state))
    finally:
        ranks.layer_groups.cache_clear()
    layers = backend.model.config.num_hidden_layers
    assert layers == 2 and len(groups) == layers + 1
    assert sorted(i for group in groups for i in group) == list(range(len(jax.tree.leaves(backend.lora_params))))
    moments = [node for node in nodes if isinstance(node, list)]
    assert len(moments) == 2  # Adam's mu and nu
    others = [node for node in nodes if not isinstance(node, list)]
    assert sorted([i for m in moments for i in m] + others) == list(range(len(jax.tree.leaves(optimizer.opt_state))))
    assert program._cache_size() == 2  # a layer's program, the same for both layers, and the rest's
