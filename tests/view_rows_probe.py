"""`python -m tests.view_rows_probe [beside]`: what SkyRL-tx's backend, with every change a rank gets, samples for
one adapter's prompts in a batch of that adapter only (`one-adapter-batches`: a one-slot view), and again
with other rows beside them, at other positions: rows of the same adapter, or of adapter `beside` (what upstream's
engine batches together): greedy tokens, their logprobs and the prompts' logprobs, as JSON on the last line; and the
base model's, for the same prompts. SmolLM2 in bfloat16 (the tiny model's float32 rounds nothing apart), the
adapters' LoRA factors drawn at random. A process of its own: the ranks' changes patch upstream's classes."""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from tx.tinker import types
from tx.tinker.backends import jax as backend

from txflow.upstream.skyrl_tx import ranks
from txflow.upstream.tiny_model import resolve_base_model

RANK = 32


def drawn_adapter(impl, model: str) -> None:
    """`model`'s LoRA factors drawn at random (a fresh adapter's B is zero: it would add nothing to round)."""
    impl.create_model(model, types.LoraConfig(rank=RANK, alpha=32.0, seed=0))
    impl.models[model].loaded_checkpoint_id = "live"
    slot = impl.models[model].adapter_index
    keys = iter(jax.random.split(jax.random.key(0), 10_000))

    def drawn(path, w):
        names = {getattr(k, "key", None) for k in path}
        if not names & {"lora_A", "lora_B"}:
            return w
        scale = 0.02 if "lora_B" in names else 0.05
        return w.at[slot].set((jax.random.normal(next(keys), w[slot].shape) * scale).astype(w.dtype))

    impl.lora_params = jax.tree_util.tree_map_with_path(drawn, impl.lora_params)


def sample(impl, rows: list[tuple[str, list[int]]]) -> list[dict]:
    """Greedy samples of 6 tokens with the prompts' logprobs (an evaluation's call), of each (model, prompt); model
    "" is the base model."""
    params = types.SamplingParams(temperature=0.0, max_tokens=6, seed=0)
    models, prompts = [m for m, _ in rows], [p for _, p in rows]
    batch = types.PreparedSampleBatch(
        all_prompts=prompts, all_sampling_params=[params] * len(prompts), all_model_ids=models,
        all_checkpoint_ids=["live" if m else "" for m in models], all_checkpoint_paths=[""] * len(prompts),
        needs_prompt_logprobs=True, request_batch_slices=[(f"r{i}", m, i, i + 1, True) for i, m in enumerate(models)])
    out = impl.sample(batch)
    return [{"tokens": [int(t) for t in out[f"r{i}"].sequences[0].tokens],
             "logprobs": [float(x) for x in out[f"r{i}"].sequences[0].logprobs],
             "prompt_logprobs": [float(x) for x in out[f"r{i}"].prompt_logprobs[1:]]} for i in range(len(prompts))]


def main() -> None:
    ranks.install()
    # 2 rows a batch as upstream sizes it: an evaluation's batch runs 4 times that (`sampling-rows`), 8 rows
    impl = backend.JaxBackendImpl(resolve_base_model("smollm2-135m"), backend.JaxBackendConfig(
        max_lora_adapters=4, max_lora_rank=RANK, sample_max_num_sequences=2))
    drawn_adapter(impl, "other")  # slot 1: the adapter sampled below is in another slot than the first
    drawn_adapter(impl, "a")
    prompts = [[int(t) for t in np.random.default_rng(40 + i).integers(1, 2000, 10 + i)] for i in range(5)]
    beside = sys.argv[1] if len(sys.argv) > 1 else "a"
    alone = sample(impl, [("a", p) for p in prompts[:3]])
    among = sample(impl, [(beside, prompts[4]), ("a", prompts[2]), ("a", prompts[0]), (beside, prompts[3]),
                          ("a", prompts[1])])
    base = sample(impl, [("", p) for p in prompts[:3]])
    print(json.dumps({"dtype": str(impl.model_config.dtype), "alone": alone, "among": [among[2], among[4], among[1]],
                      "base": base}))


if __name__ == "__main__":
    main()
