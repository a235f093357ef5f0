"""The same SFT job as `txflow run sft`, by hand: no Prefect, no txflow machinery.

What a user without txflow does: start SkyRL-tx's API server (which spawns the
engine with `uv run ...`; a throwaway `uv` on PATH maps that to this
interpreter, as a uv-managed SkyRL checkout would) and one JAX worker per
extra process, all at once; wait for /healthz; run a cookbook-style loop
(forward_backward and optim_step both in flight, then the results); save the
state and the sampler weights; restore the state into a fresh client and run
a forward pass; sample greedily from the saved sampler; kill everything.

The job is the flow's, batch for batch: the same held-out tenth of the data
(the flow evaluates on it), the same seeded shuffle per epoch (both from
`txflow.training.sft.split` and `txflow.training.datasets.batch_indices`, plain data code) and the same adapter
seed. So both sides compute the same losses, which the benchmark checks; a
different data order alone moved the ranks' peak RSS by ~50 MiB at 100 steps.

`--mode rl`: the cookbook's RL loop by hand on the same cluster: each step saves
the weights for a sampler, sends every prompt's group of samples before awaiting
any, scores them, and sends forward_backward (importance sampling, group-relative
advantages) with optim_step in flight; the prompts, seeds, reward and datums are
the flow's (`txflow.training.rl`'s data code), so both sides sample the same
rollouts. A chat model's rows are rendered with its chat template as the flow
renders them (`txflow.training.sft.encode`).

Prints one JSON object: seconds per phase, per-step seconds and per-step
losses (rl: mean rewards) (the benchmark reads memory and CPU from /proc itself). Used by
`scripts/bench_flow.py`; not part of txflow.

    python scripts/bench_by_hand.py --model-dir DIR --dataset FILE [--steps 20] [--processes 2]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

UV_SHIM = """#!/bin/sh
# `uv run --extra tinker --extra jax -m tx.tinker.engine ...` -> this interpreter, without the extras.
shift
while [ "$1" = "--extra" ]; do shift 2; done
exec {python} "$@"
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=2e-2)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=("sft", "rl"), default="sft")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--reward", default="txflow.training.rewards:low_token_ids")
    args = parser.parse_args()

    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="by-hand-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its processes have stopped by then
    (work / "bin").mkdir()
    shim = work / "bin" / "uv"
    shim.write_text(UV_SHIM.format(python=sys.executable))
    shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{work / 'bin'}:{os.environ['PATH']}", HF_HUB_OFFLINE="1")
    api_port, coordinator_port = free_port(), free_port()
    n = args.processes
    backend = {"max_lora_rank": max(32, args.lora_rank), "max_lora_adapters": 8, "sample_max_num_sequences": 8,
               "fully_sharded_data_parallel_size": n}
    if n > 1:
        backend.update(coordinator_address=f"127.0.0.1:{coordinator_port}", num_processes=n)
    commands = [[sys.executable, "-m", "tx.tinker.api", "--host", "127.0.0.1", "--port", str(api_port),
                 "--base-model", args.model_dir, "--backend-config", json.dumps(backend),
                 "--database-url", f"sqlite:///{work / 'tinker.db'}", "--checkpoints-base", str(work / "ckpt")]]
    commands += [[sys.executable, "-m", "tx.tinker.backends.jax", "--coordinator-address",
                  f"127.0.0.1:{coordinator_port}", "--num-processes", str(n), "--process-id", str(rank)]
                 for rank in range(1, n)]
    procs = [subprocess.Popen(cmd, env=env, stdout=open(work / f"proc{i}.log", "w"), stderr=subprocess.STDOUT,
                              start_new_session=True) for i, cmd in enumerate(commands)]
    phases: dict[str, float] = {}
    step_seconds: list[float] = []
    losses: list[float] = []
    try:
        base_url = f"http://127.0.0.1:{api_port}"
        while True:
            try:
                urllib.request.urlopen(f"{base_url}/api/v1/healthz", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        import tinker
        from tinker import types
        from transformers import AutoTokenizer

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from txflow.training.datasets import batch_indices
        from txflow.training.sft import split

        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line.strip()]

        from txflow.training import rl, sft
        from txflow.training.rewards import load_reward

        def datum(row):
            tokens, weights = sft.encode(row, tokenizer, 1 << 30, args.dataset)
            return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]})

        service = tinker.ServiceClient(base_url=base_url, api_key="tml-by-hand")
        training = service.create_lora_training_client(base_model=args.model_dir, rank=args.lora_rank,
                                                       seed=args.seed, train_unembed=False)
        phases["cluster_up"] = time.monotonic() - began
        adam = types.AdamParams(learning_rate=args.learning_rate)
        if args.mode == "rl":
            data = rl.prepare(rows, tokenizer, 1 << 30, args.max_tokens, args.dataset, load_reward(args.reward),
                              args.reward)
            waits = type("Waits", (), {"wait": staticmethod(lambda future, what, timeout: future.result())})()
            for step in range(args.steps):
                started = time.monotonic()
                policy = training.save_weights_and_get_sampling_client()
                indices = batch_indices(len(data.prompts), step, args.batch_size, args.seed)
                groups = rl.sample_groups(policy, data, indices, args.group_size, args.max_tokens, args.temperature,
                                          args.seed * 100_003 + step, waits, 600)
                batch = sft.averaged(rl.to_datums(groups, data))
                fwd_bwd = training.forward_backward(batch, "importance_sampling")
                optim = training.optim_step(adam)
                fwd_bwd.result()
                optim.result()
                rewards = rl.rewards_of(groups)
                losses.append(sum(rewards) / len(rewards))
                step_seconds.append(time.monotonic() - started)
        else:
            data = [datum(row) for row in split(rows)[0]]
        for step in range(args.steps if args.mode == "sft" else 0):
            started = time.monotonic()
            batch = [data[i] for i in batch_indices(len(data), step, args.batch_size, args.seed)]
            fwd_bwd = training.forward_backward(batch, "cross_entropy")
            optim = training.optim_step(adam)
            out = fwd_bwd.result()
            optim.result()
            total = weight = 0.0
            for output, d in zip(out.loss_fn_outputs, batch):
                for logprob, w in zip(output["logprobs"].tolist(), d.loss_fn_inputs["weights"].tolist()):
                    total -= logprob * w
                    weight += w
            losses.append(total / max(weight, 1.0))
            step_seconds.append(time.monotonic() - started)
        phases["train"] = sum(step_seconds)
        started = time.monotonic()
        if args.mode == "sft":  # the benchmark compares RL steps only
            state = training.save_state("final").result().path
            sampler = training.save_weights_for_sampler("final-sampler").result().path
            restored = service.create_training_client_from_state(state)
            restored.forward(data[: args.batch_size], "cross_entropy").result()
            prompt = types.ModelInput.from_ints(tokenizer.encode(rows[0]["prompt"], add_special_tokens=False))
            service.create_sampling_client(model_path=sampler).sample(
                prompt=prompt, num_samples=1,
                sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0)).result()
        phases["save_restore"] = time.monotonic() - started
        service.holder.close()
    finally:
        started = time.monotonic()
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in procs:
            proc.wait()
        phases["teardown"] = time.monotonic() - started
    phases["total"] = time.monotonic() - began
    print(json.dumps({"phases": {k: round(v, 3) for k, v in phases.items()},
                      "step_seconds": [round(s, 4) for s in step_seconds], "steps": len(step_seconds),
                      "losses": losses}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
