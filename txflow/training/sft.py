"""Supervised fine-tuning: cross-entropy on completion tokens only."""

from __future__ import annotations

from dataclasses import dataclass, field

from txflow.training.tokenizer import chat_template, render_chat

# tinker is imported where a Datum is built: it imports torch (~4 s), and pre-flight must stay fast.

Example = tuple[list[int], list[int]]  # tokens, per-token loss weights


@dataclass
class SFTData:
    train: list[Example]
    eval: list[Example]
    eval_rows: list[dict] = field(default_factory=list)  # the rows of `eval`: the answers a report shows
    tokenizer: object = None


def encode(row: dict, tokenizer, max_len: int, where: str) -> Example:
    """Prompt then completion (+ EOS); only completion tokens carry loss. A model with a chat template sees
    the row as a user turn (with the template's generation prompt, weight 0) and the assistant's reply up to
    and including its end-of-turn token (weight 1), as the tinker-cookbook's renderers weight it."""
    if chat_template(tokenizer) is None:
        prompt = tokenizer.encode(row["prompt"], add_special_tokens=False)
        completion = tokenizer.encode(row["completion"], add_special_tokens=False) + [tokenizer.eos_token_id]
    else:
        prompt, completion = _chat_example(row, tokenizer, where)
    tokens = prompt + completion
    if len(tokens) > max_len:
        raise ValueError(f"{where}: {len(tokens)} tokens, longer than the model's context of {max_len}")
    return tokens, [0.0] * len(prompt) + [1.0] * len(completion)


def _chat_example(row: dict, tokenizer, where: str) -> tuple[list[int], list[int]]:
    user = [{"role": "user", "content": row["prompt"]}]
    prompt_text = render_chat(tokenizer, user, add_generation_prompt=True)
    full_text = render_chat(tokenizer, user + [{"role": "assistant", "content": row["completion"]}],
                            add_generation_prompt=False)
    if not full_text.startswith(prompt_text):
        raise ValueError(f"{where}: the model's chat template renders the reply so that the prompt is not its "
                         f"prefix; txflow cannot tell prompt tokens from reply tokens with it")
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    completion = tokenizer.encode(full_text[len(prompt_text):], add_special_tokens=False)
    eos = tokenizer.eos_token_id
    if eos in completion:
        # What follows the end of turn (ChatML's newline) opens the next turn: not the reply's to learn.
        completion = completion[: len(completion) - completion[::-1].index(eos)]
    else:
        completion.append(eos)
    return prompt, completion


def prepare(rows: list[dict], tokenizer, max_len: int, url: str) -> SFTData:
    """Tokenize every row; the last tenth is held out for evaluation (`split`)."""
    examples = [encode(row, tokenizer, max_len, f"{url} line {i + 1}") for i, row in enumerate(rows)]
    train, held_out = split(examples)
    held_rows = split(rows)[1] or rows[:1]
    return SFTData(train=train, eval=held_out or train[:1], eval_rows=held_rows, tokenizer=tokenizer)


def split(items: list) -> tuple[list, list]:
    """(train, held out): the last tenth, at least one item, is held out; a single item is all train."""
    held_out = max(1, len(items) // 10) if len(items) > 1 else 0
    return items[: len(items) - held_out], items[len(items) - held_out :]


def to_datum(example: Example):
    """A cross-entropy Datum: predict each next token, weighted. Tinker sums a loss over tokens; weights of
    1 / (completion tokens) make a sequence count its mean loss per token (see `averaged`)."""
    from txflow.upstream.tinker_sdk import tinker

    tokens, weights = example
    completion = sum(weights[1:]) or 1.0
    return tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [w / completion for w in weights[1:]]},
    )


def averaged(datums: list) -> list:
    """The datums with their weights divided by their number. Tinker sums a loss over the sequences of a
    request; with per-sequence weights that average over each sequence (`to_datum`, `rl.to_datums`) this
    makes the loss the mean over sequences of each sequence's mean: the exact loss SkyRL-tx 0.3.0
    computed itself, so runs train as before (Adam's epsilon makes even a constant factor show) and the
    by-hand benchmark on upstream's engine trains the same job."""
    from txflow.upstream.tinker_sdk import tinker

    n = len(datums)
    return [tinker.types.Datum(model_input=d.model_input,
                               loss_fn_inputs={k: [w / n for w in v.tolist()] if k == "weights" else v
                                               for k, v in d.loss_fn_inputs.items()})
            for d in datums]


def mean_nll(output, examples: list[Example]) -> tuple[float, int]:
    """Mean negative log-likelihood per completion token, and that token count."""
    total, tokens = 0.0, 0
    for out, (_, weights) in zip(output.loss_fn_outputs, examples):
        logprobs = out["logprobs"].tolist()
        for logprob, weight in zip(logprobs, weights[1:]):
            total -= logprob * weight
            tokens += int(weight)
    return total / max(tokens, 1), tokens
