"""How near the engine's steps run to this machine's limits: the CPU's measured matmul peak and memory bandwidth,
the FLOPs and bytes a step needs (counted from the model's config), and the engine's measured step in one process
(SkyRL-tx's JAX backend with every change a rank gets; no API, so this is the engine's own cost).

Prints, for the demo's SFT step (4 rows, 64-token bucket) and the nightly RL step (8 prompts that share a few-shot
prefix x 4 samples of 4 tokens, then one update on the 32 rollouts):
- the peak: a jitted chain of the model's own matmuls (hidden x intermediate, each layer's), forward and
  forward + backward, in float32, bfloat16, and bfloat16 products summed in float32 (as the engine multiplies on a
  CPU with bfloat16 dot instructions); the best of them is the roofline's FLOP rate;
- the bandwidth: a jitted sum over 1 GiB;
- the SFT step: its FLOPs, the roofline time (FLOPs / peak), the measured forward + backward and optimizer
  step, and the fraction of the roofline it reaches (target >= 0.5);
- the RL step: the estimate (prefill and training FLOPs at the peak, decoding at the larger of its FLOPs at
  the peak and its weight reads at the bandwidth, the optimizer's reads and writes at the bandwidth) beside the
  measured sample + forward_backward + optim_step, their ratio (target <= 2), and the sampled tokens per
  second against the bandwidth's limit.
Not part of txflow; `make bench` runs it.

    python scripts/bench_roofline.py [--base-model smollm2-135m] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

@dataclass(frozen=True)
class Shapes:
    """What the FLOP count needs of a decoder-only model's config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: dict) -> Shapes:
        heads = config["num_attention_heads"]
        return cls(hidden=config["hidden_size"], intermediate=config["intermediate_size"],
                   layers=config["num_hidden_layers"], heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads, vocab=config["vocab_size"])

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of one layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv), "v_proj": (self.hidden, kv),
                "o_proj": (q, self.hidden), "gate_proj": (self.hidden, self.intermediate),
                "up_proj": (self.hidden, self.intermediate), "down_proj": (self.intermediate, self.hidden)}

    def weight_bytes(self, itemsize: int) -> int:
        per_layer = sum(i * o for i, o in self.linears().values())
        return (self.layers * per_layer + self.vocab * self.hidden) * itemsize


def forward_flops(shapes: Shapes, tokens: int, context: int, rank: int, logits: int) -> float:
    """FLOPs of a forward pass over `tokens` positions, each attending over `context` positions (a program
    computes the whole padded square), with a LoRA of `rank` on every projection and the output head over
    `logits` positions. A multiply-add is 2 FLOPs; norms, activations and the softmax are left out (a few
    per cent at these sizes)."""
    linears = shapes.linears()
    dense = sum(i * o for i, o in linears.values())
    lora = sum(rank * (i + o) for i, o in linears.values())
    attention = 2 * shapes.heads * shapes.head_dim * context  # scores and the weighted sum, per position
    per_layer = 2 * (dense + lora) * tokens + 2 * attention * tokens
    return shapes.layers * per_layer + 2 * shapes.vocab * shapes.hidden * logits


def train_flops(shapes: Shapes, rows: int, length: int, rank: int) -> float:
    """forward + backward of a LoRA step on `rows` x `length` padded tokens: the backward takes the gradient
    to every activation (as much as the forward) and to the LoRA weights (the LoRA's part once more); the
    frozen weights get none."""
    tokens = rows * length
    forward = forward_flops(shapes, tokens, length, rank, tokens)
    lora = shapes.layers * sum(2 * rank * (i + o) for i, o in shapes.linears().values()) * tokens
    return 2 * forward + lora


def packed_train_flops(shapes: Shapes, packed_rows: int, packed_length: int, queries: int, rank: int) -> float:
    """train_flops of a micro-batch packed by `packed-prefixes`: the layers over the packed rows, the output head
    (forward, and backward to the hidden states) over its logprob queries, each distinct (position, target) once."""
    head = 2 * 2 * shapes.vocab * shapes.hidden  # per position: the forward and the gradient to the hidden state
    return train_flops(shapes, packed_rows, packed_length, rank) + head * (queries - packed_rows * packed_length)


def timed(function, *args, repeat: int) -> float:
    """The best of `repeat` calls, after one that compiles."""
    import jax

    jax.block_until_ready(function(*args))
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        jax.block_until_ready(function(*args))
        best = min(best, time.perf_counter() - began)
    return best


def bfloat16_products_chain():
    """The MLP chain of `machine_peak` with every product (forward, and the backward's to the input and to the
    weights) of bfloat16 operands into a float32 result, the weights carried through the scan as their bits: the
    fastest way this benchmark knows to multiply on a CPU with bfloat16 units (XLA multiplies bfloat16 on them only
    so; a bfloat16 array a loop slices it widens to float32 first). The benchmark's own code, as the engine's
    `bfloat16-products-on-cpu` does it."""
    import jax
    import jax.numpy as jnp

    def bits(x):
        return jax.lax.bitcast_convert_type(x, jnp.uint16)

    def bfloat16(x):
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16)

    def product(a, b, contract):
        return jax.lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), (contract, ((), ())),
                                   preferred_element_type=jnp.float32)

    @jax.custom_vjp
    def matmul(h, w):
        return product(h, bfloat16(w), ((1,), (0,)))

    def forward(h, w):
        return matmul(h, w), (h.astype(jnp.bfloat16), w)

    def backward(residuals, g):
        h, w = residuals
        return product(g, bfloat16(w), ((1,), (1,))), bits(product(h, g, ((0,), (0,))).astype(jnp.bfloat16))

    matmul.defvjp(forward, backward)

    def chain(x, up, down):
        def layer(h, weights):
            return h + matmul(jax.nn.silu(matmul(h, weights[0])), weights[1]), None
        return jax.lax.scan(layer, x, (bits(up), bits(down)))[0]

    return chain


def machine_peak(shapes: Shapes, tokens: int, repeat: int) -> dict:
    """GFLOP/s of the model's MLP matmuls chained through its layers (under a scan, as the engine runs them),
    forward and forward + backward, in float32, in bfloat16 and in bfloat16 products summed in float32
    (`bfloat16_products_chain`); and GB/s of a sum over 1 GiB."""
    import jax
    import jax.numpy as jnp

    rates = {}
    key = jax.random.PRNGKey(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        up = (jax.random.normal(key, (shapes.layers, shapes.hidden, shapes.intermediate)) * 0.02).astype(dtype)
        down = (jax.random.normal(key, (shapes.layers, shapes.intermediate, shapes.hidden)) * 0.02).astype(dtype)
        x = jax.random.normal(key, (tokens, shapes.hidden)).astype(dtype)

        def chain(x, up, down):
            def layer(h, weights):
                return h + jax.nn.silu(h @ weights[0]) @ weights[1], None
            return jax.lax.scan(layer, x, (up, down))[0]

        # the gradient to the weights too: the 3 x `flops` below count it (before 2026-12-07 only the input's was
        # asked for, 2 x `flops` of work, so these rates read 1.5 times what the chain did)
        grad = jax.jit(jax.grad(lambda x, up, down: chain(x, up, down).astype(jnp.float32).sum(),
                                argnums=(0, 1, 2)))
        flops = shapes.layers * 2 * 2 * tokens * shapes.hidden * shapes.intermediate
        name = jnp.dtype(dtype).name
        rates[f"{name} forward"] = flops / timed(jax.jit(chain), x, up, down, repeat=repeat) / 1e9
        rates[f"{name} forward+backward"] = 3 * flops / timed(grad, x, up, down, repeat=repeat) / 1e9
    up = (jax.random.normal(key, (shapes.layers, shapes.hidden, shapes.intermediate)) * 0.02).astype(jnp.bfloat16)
    down = (jax.random.normal(key, (shapes.layers, shapes.intermediate, shapes.hidden)) * 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(key, (tokens, shapes.hidden))
    chain = bfloat16_products_chain()
    grad = jax.jit(jax.grad(lambda x, up, down: chain(x, up, down).sum(), argnums=(0, 1, 2)))
    flops = shapes.layers * 2 * 2 * tokens * shapes.hidden * shapes.intermediate
    rates["bfloat16 products forward"] = flops / timed(jax.jit(chain), x, up, down, repeat=repeat) / 1e9
    rates["bfloat16 products forward+backward"] = 3 * flops / timed(grad, x, up, down, repeat=repeat) / 1e9
    big = jnp.ones((2**28,), jnp.float32)  # 1 GiB
    bandwidth = big.nbytes / timed(jax.jit(jnp.sum), big, repeat=repeat) / 1e9
    return {"gflops": {k: round(v, 1) for k, v in rates.items()}, "peak_gflops": round(max(rates.values()), 1),
            "bandwidth_gbs": round(bandwidth, 1)}


def engine(model_dir: str, adapters: int, rank: int):
    """SkyRL-tx's backend with the changes every rank gets (`txflow.upstream.skyrl_tx.ranks.install`), a model
    of LoRA `rank` created."""
    from tx.tinker import types
    from tx.tinker.backends import jax as backend

    from txflow.config import RunConfig
    from txflow.upstream.skyrl_tx import ranks
    from txflow.upstream.skyrl_tx.launch import backend_config

    ranks.install()
    # a run's micro-batch and sampling batch sizes (one process), which the packing and the sampling rows go by, and
    # its logprobs' chunks
    sizes = {key: backend_config(RunConfig(), None)[key] for key in ("train_micro_batch_size",
                                                                      "sample_max_num_sequences", "loss_chunk_size")}
    impl = backend.JaxBackendImpl(model_dir, backend.JaxBackendConfig(max_lora_adapters=adapters,
                                                                      max_lora_rank=rank, **sizes))
    impl.create_model("m", types.LoraConfig(rank=rank, alpha=32.0, seed=0))
    return impl


def train_batch(rows: list[list[int]], weighted: int, loss: str):
    """A forward_backward batch of `rows` (the model's input tokens) with Tinker's `loss`, the last `weighted`
    positions of each carrying it (an RL rollout's sampled tokens; an SFT row's completion)."""
    from tx.tinker import types

    n = len(rows)
    return types.PreparedModelPassBatch(
        all_input_ids=rows, all_targets=[r[1:] + [r[0]] for r in rows],
        all_token_weights=[[0.0] * (len(r) - weighted) + [1.0 / weighted] * weighted for r in rows],
        all_sampling_logprobs=[[-1.0] * len(r) for r in rows], all_advantages=[[0.5] * len(r) for r in rows],
        all_model_ids=["m"] * n, all_loss_fn_types=[types.LOSS_TYPES[loss]] * n, all_loss_fn_configs=[None] * n,
        request_batch_slices=[("r", "m", 0, n)])


def sample_batch(prompts: list[list[int]], samples: int, max_tokens: int):
    from tx.tinker import types

    params = types.SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1)
    rows = [p for p in prompts for _ in range(samples)]
    # The base model's weights (model id ""): a trained adapter's sampling costs the same.
    return types.PreparedSampleBatch(
        all_prompts=rows, all_sampling_params=[params] * len(rows), all_model_ids=[""] * len(rows),
        all_checkpoint_ids=[""] * len(rows), all_checkpoint_paths=[""] * len(rows), needs_prompt_logprobs=False,
        request_batch_slices=[(f"r{i}", "", samples * i, samples * (i + 1), False) for i in range(len(prompts))])


def measured(impl, call, repeat: int) -> float:
    """The median of `repeat` calls after one that compiles."""
    call(impl)
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        call(impl)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def training_step(impl, batch, repeat: int) -> tuple[float, float]:
    """Median seconds of forward_backward and of the optimizer step after it (an optimizer step without
    gradients is skipped), over `repeat` steps after one that compiles."""
    forward_backward, optimizer = [], []
    for _ in range(repeat + 1):
        began = time.perf_counter()
        impl.forward_backward(batch)
        middle = time.perf_counter()
        optimizer_step(impl)
        forward_backward.append(middle - began)
        optimizer.append(time.perf_counter() - middle)
    return statistics.median(forward_backward[1:]), statistics.median(optimizer[1:])


def optimizer_step(impl) -> None:
    import jax
    from tx.tinker import types

    impl.optim_step("m", types.OptimStepInput(adam_params=types.AdamParams(
        learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0)))
    jax.block_until_ready(impl.lora_params)


def optimizer_bytes(impl, model_id: str = "m") -> int:
    """What the model's Adam step reads and writes: its own slot (`optimizer-own-slot`) of the LoRA weights and of
    the gradient sums, each read and written (the sums reset), and its two moments read and written. Every other
    slot is left where it is (`slots-written-in-place`)."""
    import jax
    from flax import nnx

    weights = jax.tree.leaves(impl.lora_params)
    slot = sum(x.nbytes for x in weights) // weights[0].shape[0]  # the gradient sums: the same shapes and dtypes
    moments = sum(x.nbytes for x in jax.tree.leaves(nnx.state(impl.optimizers[model_id])) if hasattr(x, "nbytes"))
    return 2 * (2 * slot + moments)


def met(held: bool) -> str:
    return "met" if held else "not met"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", default="smollm2-135m")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8, help="adapter slots, as a run's cluster holds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from tx.utils.models import round_up_seq_len

    from txflow.upstream.tiny_model import resolve_base_model

    model_dir = resolve_base_model(args.base_model)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = Shapes.of(config)
    itemsize = 2 if config.get("torch_dtype", config.get("dtype")) in ("bfloat16", "float16") else 4
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, shapes.vocab) for _ in range(n)]

    peak = machine_peak(shapes, tokens=256, repeat=args.repeat)
    flop_rate, bandwidth = peak["peak_gflops"] * 1e9, peak["bandwidth_gbs"] * 1e9
    impl = engine(model_dir, args.adapters, args.lora_rank)
    optimizer_estimate = optimizer_bytes(impl) / bandwidth

    # The demo's step: 4 rows of ~50 tokens, padded to the 64-token bucket, ~12 of them completion tokens.
    sft_rows, sft_length = 4, 64
    sft = train_batch([tokens(50) for _ in range(sft_rows)], weighted=12, loss="cross_entropy")
    sft_flops = train_flops(shapes, sft_rows, sft_length, args.lora_rank)
    sft_s, optimizer_s = training_step(impl, sft, args.repeat)
    sft_roofline = sft_flops / flop_rate

    # The nightly RL step: 8 prompts of 74 tokens, the first 54 the same for each (SmolLM2's system prompt and the
    # few-shot turn), 4 samples of 4 tokens each, then one update on the 32 rollouts.
    prompts, samples, max_tokens, prompt_length, shared = 8, 4, 4, 74, 54
    rollouts = prompts * samples
    few_shot = tokens(shared)
    prompt_rows = [few_shot + tokens(prompt_length - shared) for _ in range(prompts)]
    sampling = sample_batch(prompt_rows, samples, max_tokens)
    rl_train = train_batch([p + tokens(max_tokens - 1) for p in prompt_rows for _ in range(samples)],
                           weighted=max_tokens, loss="importance_sampling")
    sample_s = measured(impl, lambda e: e.sample(sampling), args.repeat)
    rl_fb_s, rl_optimizer_s = training_step(impl, rl_train, args.repeat)
    prompt_bucket = round_up_seq_len(max(prompt_length, 64))
    train_length = round_up_seq_len(prompt_length + max_tokens - 1)
    # The prefill runs once per distinct prompt (`prefill-once-per-prompt`), padded to its bucket, the head only
    # at the last position; each decoding step runs every row at one position and reads every weight once.
    prefill = forward_flops(shapes, prompts * prompt_bucket, prompt_bucket, args.lora_rank, prompts)
    decode_flops = max_tokens * forward_flops(shapes, rollouts, prompt_bucket + max_tokens, args.lora_rank,
                                              rollouts)
    decode_bytes = max_tokens * shapes.weight_bytes(itemsize)
    # The engine trains the rollouts packed as a prefix tree, every shared token once, and asks the head for each
    # distinct (position, target) once (`packed-prefixes`); `unpacked` is what it would compute row by row.
    from tx.tinker.backends.utils import pad_batch

    from txflow.upstream.skyrl_tx import packing

    plan = packing.plan_for([np.asarray(row) for row in rl_train.all_input_ids], [1] * rollouts, train_length)
    unpacked = train_flops(shapes, rollouts, train_length, args.lora_rank)
    if plan is not None:
        queries = packing.queries_for(plan, pad_batch(rl_train.all_targets, train_length, np.int32)).count
    train = unpacked if plan is None else packed_train_flops(shapes, plan.rows, plan.length, queries, args.lora_rank)
    parts = {"prefill": prefill / flop_rate, "decode": max(decode_flops / flop_rate, decode_bytes / bandwidth),
             "forward_backward": train / flop_rate, "optimizer": optimizer_estimate}
    rl_estimate = sum(parts.values())
    rl_measured = sample_s + rl_fb_s + rl_optimizer_s

    result = {
        "machine": peak,
        "sft_step": {"rows": sft_rows, "bucket": sft_length, "gflop": round(sft_flops / 1e9, 1),
                     "roofline_s": round(sft_roofline, 3), "forward_backward_s": round(sft_s, 3),
                     "optimizer_s": round(optimizer_s, 3), "optimizer_estimate_s": round(optimizer_estimate, 3),
                     "fraction_of_roofline": round(sft_roofline / (sft_s + optimizer_s), 3),
                     "target_met": sft_roofline / (sft_s + optimizer_s) >= 0.5,
                     "forward_backward_fraction": round(sft_roofline / sft_s, 3),
                     "achieved_gflops": round(sft_flops / sft_s / 1e9, 1)},
        "rl_step": {"prompts": prompts, "samples": samples, "max_tokens": max_tokens,
                    "prompt_bucket": prompt_bucket, "train_bucket": train_length,
                    "packed": None if plan is None else f"{plan.rows} x {plan.length}, {queries} head queries",
                    "forward_backward_gflop": round(train / 1e9, 1), "unpacked_gflop": round(unpacked / 1e9, 1),
                    "estimate_s": {k: round(v, 3) for k, v in parts.items()} | {"total": round(rl_estimate, 3)},
                    "measured_s": {"sample": round(sample_s, 3), "forward_backward": round(rl_fb_s, 3),
                                   "optimizer": round(rl_optimizer_s, 3), "total": round(rl_measured, 3)},
                    "measured_over_estimate": round(rl_measured / rl_estimate, 2),
                    "target_met": rl_measured <= 2 * rl_estimate,
                    "sampled_tokens_per_s": round(rollouts * max_tokens / sample_s, 1),
                    "decode_tokens_per_s_at_bandwidth": round(rollouts * bandwidth / shapes.weight_bytes(itemsize),
                                                              1)},
    }
    if args.json:
        print(json.dumps(result))
        return 0
    m, s, r = result["machine"], result["sft_step"], result["rl_step"]
    print(f"machine: peak {m['peak_gflops']} GFLOP/s ({', '.join(f'{k} {v}' for k, v in m['gflops'].items())}), "
          f"bandwidth {m['bandwidth_gbs']} GB/s")
    print(f"SFT step ({s['rows']} x {s['bucket']} tokens): {s['gflop']} GFLOP, roofline {s['roofline_s']} s; "
          f"forward+backward {s['forward_backward_s']} s ({s['achieved_gflops']} GFLOP/s), optimizer "
          f"{s['optimizer_s']} s (estimate {s['optimizer_estimate_s']} s); step/roofline "
          f"{s['fraction_of_roofline']:.1%} of the roofline (target 50%: {met(s['target_met'])})")
    print(f"RL step ({r['prompts']} prompts x {r['samples']} samples of {r['max_tokens']} tokens; buckets "
          f"{r['prompt_bucket']}/{r['train_bucket']}; trained packed as {r['packed']}: {r['forward_backward_gflop']} "
          f"GFLOP, {r['unpacked_gflop']} row by row): estimate {r['estimate_s']['total']} s {r['estimate_s']}, "
          f"measured {r['measured_s']['total']} s {r['measured_s']}: {r['measured_over_estimate']}x the estimate "
          f"(target <= 2: {met(r['target_met'])}); sampled {r['sampled_tokens_per_s']} tokens/s, bandwidth's limit "
          f"for these rows {r['decode_tokens_per_s_at_bandwidth']} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
