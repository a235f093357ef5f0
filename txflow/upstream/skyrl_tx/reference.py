"""SkyRL-tx's own forward pass over a sampler checkpoint, in this process and in a dtype of our choosing.

The export proof compares transformers + peft with what SkyRL-tx computes. The cluster computes in the base
model's dtype: on a bfloat16 model its logprobs sit on bfloat16's coarse grid (a p > 0.97 token gets exactly
0.0), which no float32 model reproduces. Evaluating SkyRL-tx's own model code (`tx/models/*`) over the same
base weights and the same sampler tarball in float32 gives a reference that compares like with like.
"""

from __future__ import annotations

import json
import os
import tarfile
import tempfile
from pathlib import Path

PAD_TO = 32  # every input is padded to one multiple of this: one compiled program serves every call
ROWS = 8  # sequences per forward: [8, length, 49k vocabulary] float32 logits stay near 100 MB per 64 tokens


def lora_config_of(tarball: Path):
    """The LoraConfig a sampler tarball was trained with: its rank and alpha, and the module groups that have
    weights in it (SkyRL-tx loads only the groups its config trains)."""
    from tx.tinker.types import LoraConfig

    with tempfile.TemporaryDirectory() as tmp, tarfile.open(tarball) as tar:
        tar.extractall(tmp, filter="data")
        config = json.loads((Path(tmp) / "adapter_config.json").read_text())
        from safetensors import safe_open

        with safe_open(str(Path(tmp) / "adapter_model.safetensors"), "np") as f:
            keys = list(f.keys())
    return LoraConfig(rank=int(config["r"]), alpha=float(config["lora_alpha"]), seed=0,
                      train_attn=any(".self_attn." in k for k in keys), train_mlp=any(".mlp." in k for k in keys),
                      train_unembed=any("embed_tokens" in k or "lm_head" in k for k in keys))


def slot_ranks_and_scales(model, adapter_index: int, lora) -> None:
    """Each LoRA module's rank and scale in slot `adapter_index`, as upstream's `init_lora_adapter` sets them for
    `lora`, without the rest of what it does: it draws every module's A factor and zeroes its B, which
    `load_lora_checkpoint` then overwrites (or leaves zero, for the modules `lora` does not train): on SmolLM2,
    ~1,100 eager updates a slot. The forward reads slot `adapter_index` alone, so no other slot is set."""
    import jax
    import numpy as np
    from flax import nnx
    from tx.layers.lora import filter_lora

    def set_slot(path, value):
        kind = path[-2].key
        if kind not in ("lora_ranks", "lora_scaling"):
            return value
        module = tuple(p.key if hasattr(p, "key") else p.name for p in path)
        rank = lora.rank
        if "experts" in module:  # upstream's rank for an MoE expert layer
            rank = max(1, lora.rank // model.config.get_num_experts())
        if not filter_lora(lora, module):
            rank = 0
        array = np.array(value)
        array[adapter_index] = rank if kind == "lora_ranks" else (lora.alpha / rank if rank > 0 else 0.0)
        return jax.device_put(array.astype(value.dtype), value.sharding)

    nnx.update(model, jax.tree.map_with_path(set_slot, nnx.state(model)))


def skyrl_figures(base_model_path: str, tarball: Path, sequences: list[list[int]], prompts: list[list[int]],
                  greedy_lengths: list[int], dtype: str = "float32",
                  along_sequences: bool = False) -> tuple[list[list[float]], list[list[int]]]:
    """(per-token logprobs of each sequence after its first token, greedy continuation of each prompt of the
    given length) from SkyRL-tx's model with the tarball's adapter, computed in `dtype`. `along_sequences`: each
    sequence is its prompt followed by greedy tokens, and the second list is, for each sequence, the most likely
    next token at each of its positions after the first, from the same forward, without decoding (the caller reads
    each prompt's continuation out of it: `proof.path_greedy`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from transformers import AutoConfig
    from tx.models.configs import ModelConfig
    from tx.tinker.types import SamplingParams
    from tx.utils.models import get_dtype, get_model_class, load_lora_checkpoint, load_safetensors

    from txflow.upstream.skyrl_tx import models
    from txflow.upstream.tiny_model import cache_dir

    if not jax.config.jax_compilation_cache_dir and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        # The cluster's persistent cache (txflow.cluster.startup.child_env): a warm export compiles nothing.
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax-compilation"))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        # Every program, as the cluster's ranks keep them: building the model runs ~75 small ones (each LoRA
        # factor's initialiser), each under JAX's default threshold of 1 s, so they compiled again on every export
        # (SmolLM2: 4 s of a 21 s export).
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    lora = lora_config_of(tarball)
    config = ModelConfig(AutoConfig.from_pretrained(base_model_path), max_lora_adapters=2,
                         max_lora_rank=lora.rank, shard_attention_heads=True, loss_chunk_size=0,
                         gradient_checkpointing=False)
    mesh = jax.make_mesh((1, 1, 1), ("fsdp", "ep", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=jax.devices()[:1])
    longest = max([len(s) for s in sequences] + [len(p) + n for p, n in zip(prompts, greedy_lengths)])
    length = -(-longest // PAD_TO) * PAD_TO
    adapter = jnp.ones((ROWS,), dtype=jnp.int32)  # every row through the trained adapter (slot 1)
    models.install()  # the cluster's model code, so that the reference computes what the cluster computes
    with jax.set_mesh(mesh), nnx.use_eager_sharding(True):
        with models.base_weights_not_drawn():
            model = get_model_class(config)(config, dtype=get_dtype(dtype), rngs=nnx.Rngs(0))
        load_safetensors(base_model_path, config, model)
        slot_ranks_and_scales(model, 1, lora)
        load_lora_checkpoint(model, lora, 1, tarball)
        graphdef, weights = nnx.split(model)

        # The weights are the program's argument: closed over, they were constants that XLA folded into
        # the program (the largest part of its 80-90 s compile on SmolLM2).
        @jax.jit
        def forward(weights, tokens, mask):
            model = nnx.merge(graphdef, weights)
            states = model(tokens, attention_mask=mask, adapter_indices=adapter).last_hidden_state
            targets = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
            return jnp.argmax(model.compute_logits(states, adapter), -1), model.compute_logprobs(states, targets,
                                                                                                   adapter)

        def run(rows: list[list[int]]):
            # ROWS sequences per call, one compiled shape. Causal attention: the padding on the right changes
            # no real position, and a row's figures do not depend on the rows beside it.
            rows = rows + [[0]] * (ROWS - len(rows))
            tokens = jnp.asarray([list(r) + [0] * (length - len(r)) for r in rows], dtype=jnp.int32)
            mask = jnp.asarray([[1] * len(r) + [0] * (length - len(r)) for r in rows], dtype=jnp.int32)
            return forward(weights, tokens, mask)

        logprobs, chosen = [], []
        for start in range(0, len(sequences), ROWS):
            chunk = sequences[start:start + ROWS]
            best, found = (np.asarray(x) for x in run(chunk))
            logprobs += [found[i, : len(s) - 1].astype(np.float64).tolist() for i, s in enumerate(chunk)]
            chosen += [best[i, : len(s) - 1].tolist() for i, s in enumerate(chunk)]
        if along_sequences:
            return logprobs, chosen
        # Greedy continuations as the cluster decodes them (SkyRL-tx's generate, with its key-value cache),
        # ROWS prompts at a time: a whole forward per token took ~50 s for an SFT run's 32 prompts on 2 cores.
        greedy = []
        for start in range(0, len(prompts), ROWS):
            rows = [list(p) for p in prompts[start:start + ROWS]]
            counts = greedy_lengths[start:start + ROWS]
            params = [SamplingParams(temperature=0.0, max_tokens=max(count, 1), seed=0) for count in counts]
            rows += [[0]] * (ROWS - len(rows))
            params += [params[0]] * (ROWS - len(params))
            tokens = jnp.asarray([r + [0] * (length - len(r)) for r in rows], dtype=jnp.int32)
            mask = jnp.asarray([[1] * len(r) + [0] * (length - len(r)) for r in rows], dtype=jnp.int32)
            result = model.generate(tokens, mask, sampling_params=params, adapter_indices=adapter)
            greedy += [result.generated_ids[i][:count] for i, count in enumerate(counts)]
    return logprobs, greedy
