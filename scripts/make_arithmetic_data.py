"""Writes txflow's bundled arithmetic task (`txflow/data/arithmetic_*.jsonl`), deterministically: SFT
examples with their answers, and RL prompts with the answer the exact-answer reward checks. Run it again
after changing the task; the files it writes are committed.

    python scripts/make_arithmetic_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "txflow" / "data"
INSTRUCTION = "Reply with the number only."
FEWSHOT = [{"role": "user", "content": f"What is 4 + 5? {INSTRUCTION}"}, {"role": "assistant", "content": "9"}]


def problems(rng: random.Random, count: int) -> list[tuple[str, int]]:
    """`count` distinct problems: sums and differences of numbers below 100, products of numbers up to 12."""
    found: dict[str, int] = {}
    while len(found) < count:
        kind = rng.choice("+-*")
        if kind == "*":
            a, b = rng.randint(2, 12), rng.randint(2, 12)
            found.setdefault(f"{a} * {b}", a * b)
        else:
            a, b = rng.randint(10, 99), rng.randint(1, 99)
            if kind == "-" and b > a:
                a, b = b, a
            found.setdefault(f"{a} {kind} {b}", a + b if kind == "+" else a - b)
    return list(found.items())


def main() -> None:
    rng = random.Random(20261202)
    items = problems(rng, 400)
    # SFT: 320 examples (the last tenth held out by txflow); RL: 24 of the other problems as prompts (RL's check
    # samples every prompt, group_size times, with the base model and the trained one), each after one solved
    # example, as the cookbook's arithmetic environment (`include_fewshot`) shows its format to the policy.
    sft = [{"prompt": f"What is {q}? {INSTRUCTION}", "completion": str(a), "answer": str(a)} for q, a in items[:320]]
    rl = [{"prompt": f"What is {q}? {INSTRUCTION}", "answer": str(a), "convo_prefix": FEWSHOT}
          for q, a in items[320:344]]
    for name, rows in (("arithmetic_sft.jsonl", sft), ("arithmetic_rl.jsonl", rl)):
        (DATA / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"wrote {len(rows)} rows to {DATA / name}")


if __name__ == "__main__":
    main()
