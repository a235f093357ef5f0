"""Reward functions for `rl` mode.

A reward is any importable `module:function` called as
`fn(prompt, completion_text, completion_tokens, row) -> float`.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable

RewardFn = Callable[[str, str, list[int], dict], float]

# Token ids below this are single bytes of the tiny model's byte-level vocabulary.
LOW_TOKEN_ID = 100


def low_token_ids(prompt: str, completion_text: str, completion_tokens: list[int], row: dict) -> float:
    """Share of sampled tokens whose id is below 100: dense, so a tiny model can climb it in a few steps."""
    if not completion_tokens:
        return 0.0
    return sum(t < LOW_TOKEN_ID for t in completion_tokens) / len(completion_tokens)


_NUMBER = re.compile(r"-?\d+")


def first_number(text: str) -> int | None:
    """The first integer in `text` (a sign directly before it counts), or None."""
    found = _NUMBER.search(text.replace(",", ""))
    return int(found.group()) if found else None


def exact_answer(prompt: str, completion_text: str, completion_tokens: list[int], row: dict) -> float:
    """1 when the completion's first number is the row's `answer`, else 0: the bundled arithmetic task's
    reward (as the tinker-cookbook's arithmetic environment scores)."""
    expected = first_number(str(row["answer"]))
    return float(expected is not None and first_number(completion_text) == expected)


def close_answer(prompt: str, completion_text: str, completion_tokens: list[int], row: dict) -> float:
    """The reply's first word read as a number, as the tinker-cookbook's arithmetic environment reads it
    (`int(sample.split()[0])`): 1 for the row's `answer`; another number earns 0.25 for the answer's form and up
    to 0.25 more by how close it is (0.25 x (1 - |error| / |answer|), at least 0); a reply that does not start
    with a number earns 0. A small model rarely gets the exact answer (SmolLM2-135M: 1-4% of samples), so the
    exact reward alone gives RL nothing to climb; the form (the cookbook's format term) and the nearness give it
    a gradient, and the exact answer stays far the best reward."""
    words = completion_text.replace(",", "").split()
    expected = first_number(str(row["answer"]))
    got = int(words[0].rstrip(".")) if words and re.fullmatch(r"-?\d+\.?", words[0]) else None
    if expected is None or got is None:
        return 0.0
    if got == expected:
        return 1.0
    return 0.25 + 0.25 * max(0.0, 1.0 - abs(got - expected) / max(abs(expected), 1))


class RewardError(ValueError):
    """The reward function cannot be used; the message says why."""


def load_reward(spec: str) -> RewardFn:
    """Import `module:function`, failing with a message that says what to fix."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(f"reward {spec!r} must be 'module:function', e.g. txflow.training.rewards:low_token_ids")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"reward {spec!r}: cannot import module {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"reward {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


def score(fn: RewardFn, spec: str, prompt: str, text: str, tokens: list[int], row: dict, where: str) -> float:
    """Call the reward; a non-number or a non-finite number is an error naming the row."""
    value = fn(prompt, text, tokens, row)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RewardError(f"reward {spec} returned {value!r} for {where}; it must return a finite number")
    return float(value)
