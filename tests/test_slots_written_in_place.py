"""The `slots-written-in-place` change: a model's optimizer step, and a one-slot forward_backward's gradient sum, are
written into the engine's slot-stacked arrays in place (donated, a bfloat16 array through its bits), with every other
slot's values kept bit for bit. The step's figures themselves are held to upstream's in tests/test_checkpoint_io.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tx.tinker.backends.jax import AccumulatedGradients

from txflow.upstream.skyrl_tx import ranks

SLOTS, SLOT = 8, 3


def slot_stacked(dtype, seed: int) -> list[jax.Array]:
    """Two LoRA-like weights stacked by slot, in `dtype`."""
    keys = jax.random.split(jax.random.key(seed), 2)
    return [jax.random.normal(keys[0], (SLOTS, 512, 64)).astype(dtype),
            jax.random.normal(keys[1], (SLOTS, 64, 256)).astype(dtype)]


def host(arrays) -> list[np.ndarray]:
    return [np.asarray(a).copy() for a in arrays]


def assert_only_the_slot_changed(after, before, slot_value) -> None:
    for got, was, want in zip(after, before, slot_value, strict=True):
        got = np.asarray(got)
        np.testing.assert_array_equal(got[SLOT], np.broadcast_to(np.asarray(want), got[SLOT].shape))
        others = [i for i in range(SLOTS) if i != SLOT]
        assert got[others].tobytes() == was[others].tobytes()  # every other slot, bit for bit


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_optimizer_steps_write_writes_its_slot_and_keeps_every_other(dtype):
    lora, grads = slot_stacked(dtype, 0), slot_stacked(dtype, 1)
    counts = jnp.arange(1, SLOTS + 1, dtype=jnp.int32)
    mine = [jnp.full((1, *w.shape[1:]), 0.375, dtype) for w in lora]
    before_lora, before_grads, before_counts = host(lora), host(grads), np.asarray(counts).copy()
    new_lora, new_grads, new_counts = ranks.slot_write_program()(lora, grads, counts, mine, jnp.int32(SLOT))
    assert_only_the_slot_changed(new_lora, before_lora, [0.375] * 2)
    assert_only_the_slot_changed(new_grads, before_grads, [0.0] * 2)
    assert list(np.asarray(new_counts)) == [0 if i == SLOT else c for i, c in enumerate(before_counts)]
    assert all(a.is_deleted() for a in [*lora, *grads, counts])  # donated: the engine keeps the results only


def test_the_write_needs_no_copy_of_any_array_nor_a_pass_over_it():
    lora, grads = slot_stacked(jnp.bfloat16, 0), slot_stacked(jnp.bfloat16, 1)
    counts = jnp.ones((SLOTS,), jnp.int32)
    mine = [jnp.zeros((1, *w.shape[1:]), jnp.bfloat16) for w in lora]
    compiled = ranks.slot_write_program().lower(lora, grads, counts, mine, jnp.int32(SLOT)).compile()
    stats, whole = compiled.memory_analysis(), sum(a.nbytes for a in [*lora, *grads])
    # a bfloat16 slot written as such is a fusion over the whole array, widened to float32 and back: no float32
    assert "f32[" not in compiled.as_text()
    print(f"temporaries {stats.temp_size_in_bytes} bytes, outputs in their inputs' buffers "
          f"{stats.alias_size_in_bytes} of {whole}")
    assert stats.alias_size_in_bytes >= whole  # every array written where it was
    assert stats.temp_size_in_bytes < min(a.nbytes for a in lora) // SLOTS  # not even a slot's copy


def test_a_one_slot_pass_writes_its_gradient_sum_in_place():
    grad_sum = {"a": slot_stacked(jnp.bfloat16, 2)[0], "b": slot_stacked(jnp.bfloat16, 3)[1]}
    accumulated = AccumulatedGradients(grad_sum=grad_sum, counts=jnp.zeros((SLOTS,), jnp.int32))
    mine = {name: jnp.full((1, *w.shape[1:]), 1.5, jnp.bfloat16) for name, w in grad_sum.items()}
    adapter_indices = jnp.full((4,), SLOT, jnp.int32)
    put = ranks.slot_programs()[1]
    compiled = put.lower(accumulated, mine, jnp.int32(SLOT), adapter_indices).compile()
    assert "f32[" not in compiled.as_text()
    stats = compiled.memory_analysis()
    assert stats.temp_size_in_bytes < min(a.nbytes for a in grad_sum.values()) // SLOTS
    before = host(grad_sum.values())
    after = put(accumulated, mine, jnp.int32(SLOT), adapter_indices)
    assert_only_the_slot_changed(list(after.grad_sum.values()), before, [1.5] * 2)
    assert int(after.counts[SLOT]) == 4 and int(after.counts.sum()) == 4
