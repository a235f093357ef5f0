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
    """A row's tokens and per-token loss weights.

    A `{"prompt", "completion"}` row is the prompt then the completion (+ EOS); only completion tokens carry
    loss. With a chat template it is a user turn and the assistant's reply, as a `{"messages"}` row of those
    two. A `{"messages": [...]}` row (the cookbook's chat recipes' and hosted fine-tuning's format) is rendered
    with the model's chat template: each assistant reply, up to and including its end-of-turn token, carries
    loss (weight 1), everything else (system, user, the template's generation prompts) none, as the
    tinker-cookbook's renderers weight all assistant messages."""
    if "messages" in row:
        if chat_template(tokenizer) is None:
            raise ValueError(f"{where}: a messages row needs a model with a chat template; this one has none "
                             f"(use prompt/completion rows)")
        pieces = _chat_pieces(row["messages"], tokenizer, where)
    elif chat_template(tokenizer) is None:
        pieces = [(tokenizer.encode(row["prompt"], add_special_tokens=False), 0.0),
                  (tokenizer.encode(row["completion"], add_special_tokens=False) + [tokenizer.eos_token_id], 1.0)]
    else:
        pieces = _chat_pieces([{"role": "user", "content": row["prompt"]},
                               {"role": "assistant", "content": row["completion"]}], tokenizer, where)
    tokens = [t for ids, _ in pieces for t in ids]
    if len(tokens) > max_len:
        raise ValueError(f"{where}: {len(tokens)} tokens, longer than the model's context of {max_len}")
    return tokens, [w for ids, w in pieces for _ in ids]


def _chat_pieces(messages: list[dict], tokenizer, where: str) -> list[tuple[list[int], float]]:
    """(tokens, weight) pieces of a conversation rendered with the chat template: the text before each
    assistant reply (its generation prompt included) at weight 0, the reply through its end-of-turn token at
    weight 1. What follows an end of turn (ChatML's newline) opens the next turn: not the reply's to learn,
    and after the last reply not trained at all."""
    eos = tokenizer.eos_token_id
    eos_text = tokenizer.decode([eos], skip_special_tokens=False) if eos is not None else None
    pieces, covered = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], add_generation_prompt=True)
        after = render_chat(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (before.startswith(covered) and after.startswith(before)):
            raise ValueError(f"{where}: the model's chat template renders message {i + 1} so that what precedes "
                             f"it is not its prefix; txflow cannot tell prompt tokens from reply tokens with it")
        reply = after[len(before):]
        end = reply.rfind(eos_text) + len(eos_text) if eos_text and eos_text in reply else None
        reply_ids = tokenizer.encode(reply[:end] if end else reply, add_special_tokens=False)
        pieces += [(tokenizer.encode(before[len(covered):], add_special_tokens=False), 0.0),
                   (reply_ids if end else reply_ids + [eos], 1.0)]
        covered = before + (reply[:end] if end else reply)
    return pieces


def prepare(rows: list[dict], tokenizer, max_len: int, url: str, eval_rows: list[dict] | None = None,
            eval_url: str = "") -> SFTData:
    """Tokenize every row. Held out for evaluation: `eval_rows` (`--eval-dataset`) when given, else the last
    tenth of `rows` (`split`)."""
    examples = [encode(row, tokenizer, max_len, f"{url} line {i + 1}") for i, row in enumerate(rows)]
    if eval_rows is not None:
        held_out = [encode(row, tokenizer, max_len, f"{eval_url} line {i + 1}") for i, row in enumerate(eval_rows)]
        return SFTData(train=examples, eval=held_out, eval_rows=[shown(r) for r in eval_rows], tokenizer=tokenizer)
    train, held_out = split(examples)
    held_rows = split(rows)[1] or rows[:1]
    return SFTData(train=train, eval=held_out or train[:1], eval_rows=[shown(r) for r in held_rows],
                   tokenizer=tokenizer)


def shown(row: dict) -> dict:
    """A row as the report shows it beside the models' answers: its prompt (of a conversation, the message
    before the first reply, the one the greedy answers continue) and its expected `answer` if it has one."""
    if "messages" not in row:
        return row
    first_reply = next(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
    prompt = row["messages"][first_reply - 1]["content"] if first_reply else ""
    return {"prompt": prompt, **({"answer": row["answer"]} if "answer" in row else {})}


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
