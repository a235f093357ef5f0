"""How txflow names the state checkpoints it saves: `step-NNNNNN`, so a later save never overwrites an
earlier one and every name says its step."""

from __future__ import annotations

import re

STEP_NAME = re.compile(r"step-(\d+)")


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(url_or_path: str) -> int | None:
    """The step in the last path segment's name, or None when it names none."""
    match = STEP_NAME.search(url_or_path.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def is_txflow_state(url_or_path: str) -> bool:
    """A state txflow's own loop saved (a custom client names its checkpoints itself)."""
    return url_or_path.rstrip("/").rsplit("/", 1)[-1].startswith("step-")
