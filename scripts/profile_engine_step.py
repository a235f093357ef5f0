"""Where the engine's SFT step goes: SkyRL-tx's JAX backend driven in this process (no API, no database,
one process), with txflow's losses installed as on every rank, timed per phase for variants of its
configuration. Not part of txflow; `scripts/bench_engine_step.py` measures the step through the cluster.

    python scripts/profile_engine_step.py --base-model smollm2-135m [--steps 6] \
        [--variant adapters=8,chunk=1024] [--variant adapters=2,chunk=0,dtype=float32] ...

A variant sets `adapters` (max_lora_adapters), `chunk` (loss_chunk_size), `dtype` (the model's compute
dtype), `lora` (`upstream`: ragged_dot over every slot; `txflow`: the `lora-per-example` change) and `pad`
(`bucket`: upstream's sequence-length buckets; `exact`: the batch's own length).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def memory_mib() -> dict:
    """This process's resident set now and at its peak (MiB)."""
    status = Path("/proc/self/status").read_text().splitlines()
    return {key: int(next(line.split()[1] for line in status if line.startswith(key + ":"))) // 1024
            for key in ("VmRSS", "VmHWM")}


def parse_variant(text: str) -> dict:
    variant = {"adapters": 8, "chunk": 1024, "dtype": "model", "pad": "bucket", "lora": "upstream"}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        variant[key] = int(value) if key in ("adapters", "chunk") else value
    return variant


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--variant", action="append", default=[])
    args = parser.parse_args()

    from txflow.training import datasets, sft
    from txflow.training.tokenizer import load_tokenizer
    from txflow.upstream.skyrl_tx import losses
    from txflow.upstream.tiny_model import resolve_base_model

    model_dir = resolve_base_model(args.base_model)
    tokenizer = load_tokenizer(model_dir)
    dataset = Path(datasets.bundled_dataset("sft", args.base_model))
    rows = [json.loads(line) for line in dataset.read_text().splitlines() if line]
    data = sft.prepare(rows, tokenizer, 2048, "bundled")

    import jax
    import jax.numpy as jnp
    from tx.tinker import types
    from tx.tinker.backends import jax as backend_module
    from tx.utils import models as upstream_models

    losses.install_backend()
    upstream_dtype = backend_module.get_dtype
    upstream_round = backend_module.round_up_seq_len
    from tx.layers.lora import LoRALinear

    from txflow.upstream.skyrl_tx import ranks

    upstream_lora = LoRALinear.apply_lora
    for text in args.variant or [""]:
        variant = parse_variant(text)
        backend_module.get_dtype = (upstream_dtype if variant["dtype"] == "model"
                                    else lambda _d, name=variant["dtype"]: getattr(jnp, name))
        LoRALinear.apply_lora = upstream_lora if variant["lora"] == "upstream" else ranks.lora_per_example
        backend_module.round_up_seq_len = upstream_round if variant["pad"] == "bucket" else (lambda n: n)
        config = backend_module.JaxBackendConfig(max_lora_adapters=variant["adapters"], max_lora_rank=32,
                                                 loss_chunk_size=variant["chunk"])
        began = time.monotonic()
        impl = backend_module.JaxBackendImpl(model_dir, config)
        load_s = time.monotonic() - began
        memory = {"loaded": memory_mib()}
        impl.create_model("m", types.LoraConfig(rank=args.lora_rank, alpha=32.0, seed=0))
        adam = types.OptimStepInput(adam_params=types.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95,
                                                                  eps=1e-12, weight_decay=0.0))
        fb_s, opt_s, lengths = [], [], []
        for step in range(args.steps):
            batch = [data.train[i] for i in datasets.batch_indices(len(data.train), step, args.batch_size, 0)]
            datums = sft.averaged([sft.to_datum(e) for e in batch])
            prepared = types.PreparedModelPassBatch(
                all_input_ids=[d.model_input.to_ints() for d in datums],
                all_targets=[d.loss_fn_inputs["target_tokens"].tolist() for d in datums],
                all_token_weights=[d.loss_fn_inputs["weights"].tolist() for d in datums],
                all_sampling_logprobs=[[0.0] * d.model_input.length for d in datums],
                all_advantages=[[0.0] * d.model_input.length for d in datums],
                all_model_ids=["m"] * len(datums), all_loss_fn_types=[0] * len(datums),
                all_loss_fn_configs=[None] * len(datums), request_batch_slices=[("r", "m", 0, len(datums))])
            lengths.append(max(d.model_input.length for d in datums))
            t0 = time.monotonic()
            out = impl.forward_backward(prepared)
            t1 = time.monotonic()
            impl.optim_step("m", adam)
            jax.block_until_ready(impl.lora_params)
            t2 = time.monotonic()
            if step == 0:
                memory["first_step"] = memory_mib()
            fb_s.append(t1 - t0)
            opt_s.append(t2 - t1)
            loss = out["r"].metrics["loss:sum"]
        steady = slice(2, None)  # the first steps compile (a new length compiles again)
        print(json.dumps({"variant": variant, "load_s": round(load_s, 1), "lengths": lengths,
                          "fwd_bwd_s": [round(s, 3) for s in fb_s], "optim_s": [round(s, 3) for s in opt_s],
                          "fwd_bwd_median": round(statistics.median(fb_s[steady]), 3),
                          "optim_median": round(statistics.median(opt_s[steady]), 3), "last_loss": loss,
                          "memory_mib": {**memory, "end": memory_mib()}}),
              flush=True)
        del impl
    del upstream_models
    return 0


if __name__ == "__main__":
    sys.exit(main())
