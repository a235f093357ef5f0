"""Baseline for the engine's SFT step: what a CPU user would run instead of a cluster, a plain transformers +
peft training loop on the same batches (txflow's rendering, batch order and loss weights), the same LoRA rank
on the same 7 modules, AdamW with Tinker's defaults, the model in its own dtype, `--threads` CPU threads.

Prints one JSON object: per-step seconds (forward + backward + optimizer step) and per-step losses (the same
weighted sum the engine computes). Used by `scripts/bench_flow.py`; not part of txflow.

    python scripts/bench_plain_step.py --model-dir DIR --dataset FILE [--steps 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from txflow.training import datasets, sft
    from txflow.training.tokenizer import load_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.model_dir)
    rows = [json.loads(line) for line in Path(args.dataset).read_text().splitlines() if line.strip()]
    data = sft.prepare(rows, tokenizer, 1 << 20, args.dataset)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype="auto")  # its own (bfloat16 for SmolLM2)
    model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank,
                                             target_modules=TARGET_MODULES, lora_dropout=0.0))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                                  betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    step_seconds, losses = [], []
    for step in range(args.steps):
        started = time.monotonic()
        batch = [data.train[i] for i in datasets.batch_indices(len(data.train), step, args.batch_size, args.seed)]
        datums = sft.averaged([sft.to_datum(e) for e in batch])
        length = max(d.model_input.length for d in datums)
        inputs = torch.zeros(len(datums), length, dtype=torch.long)
        targets = torch.zeros(len(datums), length, dtype=torch.long)
        weights = torch.zeros(len(datums), length)
        mask = torch.zeros(len(datums), length, dtype=torch.long)
        for row, d in enumerate(datums):
            n = d.model_input.length
            inputs[row, :n] = torch.tensor(d.model_input.to_ints())
            targets[row, :n] = torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())
            weights[row, :n] = torch.tensor(d.loss_fn_inputs["weights"].tolist())
            mask[row, :n] = 1
        logits = model(input_ids=inputs, attention_mask=mask).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None]).squeeze(-1)
        loss = -(logprobs * weights).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step_seconds.append(time.monotonic() - started)
    print(json.dumps({"step_seconds": [round(s, 4) for s in step_seconds], "losses": losses,
                      "dtype": str(next(model.parameters()).dtype), "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
