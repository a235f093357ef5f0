"""txflow's state checkpoint I/O in the SkyRL-tx backend (txflow.upstream.skyrl_tx.checkpoint_io, the
`rank0-checkpoint-io` change), in one process on the tiny model: exact round trip, one file, checkpoints of upstream's
Orbax format still load, clear errors. The multi-process, no-shared-disk path runs end to end in
tests/test_s3_e2e.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from txflow.upstream.skyrl_tx import checkpoint_io, layout
from txflow.upstream.tiny_model import resolve_base_model

pytestmark = [pytest.mark.together]


@pytest.fixture(scope="module")
def backend():
    from tx.tinker.backends.jax import JaxBackendConfig, JaxBackendImpl

    originals = {n: JaxBackendImpl.__dict__[n]
                 for n in ("save_checkpoint", "load_checkpoint", "load_sampler_checkpoint")}
    upstream_save = originals["save_checkpoint"]
    checkpoint_io.install_checkpoint_io()
    try:
        impl = JaxBackendImpl(resolve_base_model("tiny"), JaxBackendConfig(max_lora_adapters=12, max_lora_rank=8))
        impl.upstream_save = lambda path, model_id: upstream_save(impl, path, model_id)
        yield impl
    finally:
        for name, function in originals.items():
            setattr(JaxBackendImpl, name, function)


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
