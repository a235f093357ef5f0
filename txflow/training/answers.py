"""What a person reads to see that the model learned: for held-out prompts, the base model's answer and
the trained model's side by side, and, where the rows say the expected answer, how often each is right
(the exact-answer rule of `rewards.exact_answer`)."""

from __future__ import annotations

from txflow.training.rewards import exact_answer

SHOWN = 6  # prompts shown side by side in the report


def side_by_side(tokenizer, rows: list[dict], base_tokens: list[list[int]], trained_tokens: list[list[int]],
                 shown: int = SHOWN) -> tuple[list[dict], dict[str, float]]:
    """(the first `shown` prompts with both models' greedy answers, and the accuracy figures of all of them:
    `base_accuracy` and `accuracy`, only when every row has an `answer`)."""
    found = []
    for row, base, trained in zip(rows, base_tokens, trained_tokens):
        entry = {"prompt": row["prompt"], "base": tokenizer.decode(base).strip(),
                 "trained": tokenizer.decode(trained).strip()}
        if "answer" in row:
            entry["expected"] = str(row["answer"])
        found.append(entry)
    figures = {}
    if found and all("expected" in e for e in found):
        def accuracy(key: str) -> float:
            return sum(exact_answer(e["prompt"], e[key], [], {"answer": e["expected"]}) for e in found) / len(found)

        figures = {"base_accuracy": accuracy("base"), "accuracy": accuracy("trained")}
    return found[:shown], figures
