"""JSONL datasets read through fsspec, checked before any process starts, and the order a run reads
them in."""

from __future__ import annotations

import json
import random
from importlib import resources

import fsspec

from txflow.config import TINY_MODEL

# The tiny model's toy data, and the arithmetic task every real model trains on by default
# (scripts/make_arithmetic_data.py writes it).
BUNDLED = {"sft": "sft.jsonl", "rl": "rl_prompts.jsonl"}
BUNDLED_REAL = {"sft": "arithmetic_sft.jsonl", "rl": "arithmetic_rl.jsonl"}
REQUIRED_KEYS = {"sft": ("prompt", "completion"), "rl": ("prompt",)}
# SFT also reads conversations: {"messages": [{"role": ..., "content": ...}, ...]}, rendered with the chat template.
ROLES = ("system", "user", "assistant")


class DatasetError(ValueError):
    """The dataset cannot be used; the message says where and why."""


def bundled_dataset(mode: str, base_model: str = TINY_MODEL) -> str:
    """Path of the dataset shipped with txflow for `mode` and the base model: the toy data of the tiny model,
    the arithmetic task of every other."""
    return str(resources.files("txflow.data").joinpath((BUNDLED if base_model == TINY_MODEL else BUNDLED_REAL)[mode]))


def load_jsonl(url: str, required: tuple[str, ...], storage_options: dict | None = None,
               messages: bool = False) -> list[dict]:
    """Rows of a JSONL file; every row must be an object with string values for `required`, or, with
    `messages`, may instead be a conversation (`check_messages`)."""
    try:
        with fsspec.open(url, "rt", encoding="utf-8", **(storage_options or {})) as f:
            text = f.read()
    except FileNotFoundError:
        raise DatasetError(f"Dataset {url} does not exist; pass --dataset with a JSONL file or URL") from None
    except Exception as exc:  # any backend's error (botocore's are not OSErrors): the URL cannot be used
        first = (str(exc).splitlines() or [""])[0]
        raise DatasetError(f"Dataset {url} cannot be read ({type(exc).__name__}: {first})") from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{url} line {number}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{url} line {number}: expected a JSON object, got {type(row).__name__}")
        if messages and "messages" in row:
            check_messages(row["messages"], f"{url} line {number}")
        else:
            for key in required:
                if not isinstance(row.get(key), str) or not row[key]:
                    raise DatasetError(f"{url} line {number}: needs a non-empty string field {key!r}"
                                       + (" (or a 'messages' list)" if messages else ""))
        rows.append(row)
    if not rows:
        raise DatasetError(f"Dataset {url} has no rows")
    return rows


def check_messages(messages, where: str) -> None:
    """A conversation: a list of {"role": system|user|assistant, "content": text} with at least one assistant
    reply, which has something before it to answer."""
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
    for k, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or message.get("role") not in ROLES or not isinstance(
                message.get("content"), str):
            raise DatasetError(f"{where}: message {k} must be {{\"role\": {'|'.join(ROLES)}, \"content\": "
                               f"text}}, got {json.dumps(message)[:80]}")
    replies = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    if not replies:
        raise DatasetError(f"{where}: the conversation has no assistant message to train on")
    if replies[0] == 0:
        raise DatasetError(f"{where}: the conversation opens with an assistant message; it answers nothing")


def batch_indices(num_examples: int, step: int, batch_size: int, seed: int) -> list[int]:
    """The examples of `step` (0-based): a seeded shuffle per epoch, the same on every retry."""
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(k, num_examples)
        order = list(range(num_examples))
        random.Random(seed * 100_003 + epoch).shuffle(order)
        out.append(order[offset])
    return out
