"""The `base-weights-not-drawn` change: the engine builds its model with zeros where upstream draws random base
weights, then loads the checkpoint over them; what it holds once built is upstream's, every weight and every LoRA
slot. Upstream's JAX backend, in this process, on the tiny model."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from tx.tinker import types
from tx.tinker.backends import jax as backend

from txflow.config import TINY_MODEL
from txflow.upstream.skyrl_tx import models, ranks
from txflow.upstream.tiny_model import resolve_base_model

pytestmark = [pytest.mark.together]


def built_state(monkeypatch, get_model_class) -> dict:
    """Every array of a freshly built engine with a model created, by path."""
    monkeypatch.setattr(backend, "get_model_class", get_model_class)
    impl = backend.JaxBackendImpl(resolve_base_model(TINY_MODEL), backend.JaxBackendConfig(
        max_lora_adapters=2, max_lora_rank=4, train_micro_batch_size=4, sample_max_num_sequences=1))
    impl.create_model("m", types.LoraConfig(rank=4, alpha=8.0, seed=3))
    return {path: np.asarray(jax.device_get(value)) for path, value in nnx.to_flat_state(nnx.state(impl.model))}


def test_the_engine_built_without_drawing_its_base_weights_holds_what_upstreams_holds(monkeypatch):
    upstream = getattr(backend.get_model_class, "upstream", backend.get_model_class)
    monkeypatch.setattr(backend, "get_model_class", upstream)
    ranks.base_weights_loaded_not_drawn()
    patched = backend.get_model_class
    assert patched is not upstream
    theirs, ours = built_state(monkeypatch, upstream), built_state(monkeypatch, patched)
    assert theirs.keys() == ours.keys()
    differ = [path for path in theirs if theirs[path].dtype != ours[path].dtype
              or not np.array_equal(theirs[path], ours[path])]
    assert not differ, differ[:5]
    assert any("lora_A" in str(path) and ours[path].any() for path in ours)  # the adapter's own draws, as upstream's


def test_only_the_build_sees_zeros():
    """Built inside the change, a model's base weights are zeros (nothing was drawn); outside it, upstream's
    initialisers are back and draw again."""
    from transformers import AutoConfig
    from tx.models.configs import ModelConfig
    from tx.utils.models import get_model_class

    path = resolve_base_model(TINY_MODEL)
    config = ModelConfig(AutoConfig.from_pretrained(path), max_lora_adapters=2, max_lora_rank=4,
                         shard_attention_heads=True, loss_chunk_size=0, gradient_checkpointing=False)
    mesh = jax.make_mesh((1, 1, 1), ("fsdp", "ep", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=jax.devices()[:1])
    lecun = nnx.initializers.lecun_normal
    with jax.set_mesh(mesh), nnx.use_eager_sharding(True):
        with models.base_weights_not_drawn():
            zeros = get_model_class(config)(config, dtype=jax.numpy.float32, rngs=nnx.Rngs(0))
        drawn = get_model_class(config)(config, dtype=jax.numpy.float32, rngs=nnx.Rngs(0))
    assert nnx.initializers.lecun_normal is lecun
    base = [(p, v) for p, v in nnx.to_flat_state(nnx.state(zeros)) if "lora" not in str(p)]
    assert base and not any(np.asarray(v).any() for _, v in base)
    assert any(np.asarray(v).any() for p, v in nnx.to_flat_state(nnx.state(drawn)) if "lora" not in str(p))
