"""`train_unembed` on a model that ties its output head to its embedding (the `tied-head-lora` change): the cluster
applies the embedding's LoRA at both ends of the one shared matrix, and the export writes what PEFT and a merged model
need to compute the same. On a small tied Llama built here (random weights, float32): SkyRL-tx's forward of a sampler
checkpoint, as the export's reference computes it, against transformers + peft and the merged model. The same on SmolLM2
through the cluster: the cookbook recipes in tests/test_cookbook_real_model_e2e.py."""

from __future__ import annotations

import tarfile

import pytest

from txflow.artifacts.conversion import peft_adapter
from txflow.artifacts.proof import load_base, merge

pytestmark = [pytest.mark.together]

RANK, ALPHA = 4, 8.0
SEQUENCES = [[1, 5, 9, 13, 2, 40, 41], [3, 77, 12, 60, 8]]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """(the tied model's directory, a sampler checkpoint of an adapter that trains everything, unembedding
    included, with every LoRA B made nonzero so that each module changes the model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    from transformers import AutoTokenizer

    from txflow.upstream.tiny_model import build_tiny_model

    AutoTokenizer.from_pretrained(build_tiny_model()).save_pretrained(root / "model")  # a merge copies one
    tarball = root / "sampler.tar.gz"
    write_sampler(root / "model", tarball)
    return root / "model", tarball


def write_sampler(model_dir, tarball) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from transformers import AutoConfig
    from tx.layers import lora as lora_layers
    from tx.models.configs import ModelConfig
    from tx.tinker.types import LoraConfig
    from tx.utils.models import get_model_class, load_safetensors, save_lora_checkpoint

    from txflow.upstream.skyrl_tx import models

    models.install()
    config = ModelConfig(AutoConfig.from_pretrained(model_dir), max_lora_adapters=2, max_lora_rank=RANK,
                         shard_attention_heads=True, loss_chunk_size=0, gradient_checkpointing=False)
    mesh = jax.make_mesh((1, 1, 1), ("fsdp", "ep", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=jax.devices()[:1])
    lora = LoraConfig(rank=RANK, alpha=ALPHA, seed=3, train_unembed=True)
    rng = np.random.default_rng(7)
    with jax.set_mesh(mesh), nnx.use_eager_sharding(True):
        model = get_model_class(config)(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
        load_safetensors(str(model_dir), config, model)
        lora_layers.init_lora_adapter(model, 0, LoraConfig(rank=1, alpha=1.0, seed=0))
        lora_layers.init_lora_adapter(model, 1, lora)  # upstream refuses a tied model here

        def nonzero_b(path, value):
            if path[-2].key != "lora_B":
                return value
            return value.at[1].set(jnp.asarray(rng.normal(0.0, 0.3, value[1].shape), value.dtype))

        nnx.update(model, jax.tree.map_with_path(nonzero_b, nnx.state(model)))
        save_lora_checkpoint(model, str(model_dir), lora, 1, tarball)


def skyrl_logprobs(model_dir, tarball) -> list[list[float]]:
    from txflow.upstream.skyrl_tx.reference import skyrl_figures

    logprobs, _ = skyrl_figures(str(model_dir), tarball, SEQUENCES, [], [])
    return logprobs


def logprobs_of(model) -> list[list[float]]:
    import torch

    out = []
    with torch.no_grad():
        for sequence in SEQUENCES:
            ids = torch.tensor([sequence])
            logits = model(input_ids=ids).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1).tolist())
    return out


def gap(a, b) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def peft_model(model_dir, tarball, out, tied: bool):
    from peft import PeftModel

    with tarfile.open(tarball) as tar:
        tar.extractall(out / "sampler", filter="data")
    config = peft_adapter(out / "sampler", out / "peft", str(model_dir), tied=tied)
    return PeftModel.from_pretrained(load_base(str(model_dir)), str(out / "peft")).eval(), config


def test_the_sampler_holds_the_embeddings_lora_and_no_head_of_its_own(tied):
    from safetensors import safe_open

    model_dir, tarball = tied
    with tarfile.open(tarball) as tar:
        names = tar.getnames()
        tar.extract("adapter_model.safetensors", model_dir.parent, filter="data")
    assert "adapter_model.safetensors" in names
    with safe_open(str(model_dir.parent / "adapter_model.safetensors"), "np") as f:
        keys = list(f.keys())
    assert "base_model.model.model.embed_tokens.lora_A.weight" in keys and not any("lm_head" in k for k in keys)


def test_peft_with_the_heads_copy_of_the_embeddings_lora_computes_what_skyrl_computes(tied, tmp_path):
    model_dir, tarball = tied
    expected = skyrl_logprobs(model_dir, tarball)
    model, config = peft_model(model_dir, tarball, tmp_path / "tied", tied=True)
    assert {"embed_tokens", "lm_head"} <= set(config["target_modules"])
    assert gap(logprobs_of(model), expected) < 1e-4
    # Control: the embedding's LoRA on the lookup alone (PEFT's embedding LoRA) is another model.
    alone, _ = peft_model(model_dir, tarball, tmp_path / "alone", tied=False)
    assert gap(logprobs_of(alone), expected) > 1e-2
    # And SkyRL-tx's head did apply the adapter: the base model alone is far from it too.
    assert gap(logprobs_of(load_base(str(model_dir)).eval()), expected) > 1e-2


def test_the_merged_model_stays_tied_and_computes_what_the_adapter_does(tied, tmp_path):
    import torch

    model_dir, tarball = tied
    model, config = peft_model(model_dir, tarball, tmp_path, tied=True)
    with_adapter = logprobs_of(model)
    merge(model, str(model_dir), tmp_path / "merged", config)
    merged = load_base(str(tmp_path / "merged")).eval()
    assert merged.config.tie_word_embeddings
    assert torch.equal(merged.get_input_embeddings().weight, merged.get_output_embeddings().weight)
    assert gap(logprobs_of(merged), with_adapter) < 1e-4  # the shared delta added once, not twice
