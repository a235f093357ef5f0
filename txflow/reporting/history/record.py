"""A night's record (`NightlyRecord`): when it ran, what ran (`Versions`), and its figures, a flat
`dict[str, float]` keyed `<mode>.<figure>`; and the figures a run contributes to it."""

from __future__ import annotations

import math
import re
import secrets
import statistics
import subprocess
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator

FIGURE_KEY = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)+$")


class Versions(BaseModel, extra="forbid"):
    """What ran tonight: the upstream packages and the txflow checkout."""

    skyrl_tx: str = Field(description="Installed skyrl-tx version, or 'unknown'.")
    tinker: str = Field(description="Installed tinker SDK version, or 'unknown'.")
    jax: str = Field(description="Installed jax version, or 'unknown'.")
    txflow_commit: str = Field(default="unknown", description="git commit of the txflow checkout, or 'unknown'.")


class NightlyRecord(BaseModel, extra="forbid"):
    """One nightly run: when, what ran, its figures, and how it ended."""

    id: str = Field(default_factory=lambda: secrets.token_hex(8), pattern=r"^[a-z0-9]{4,32}$",
                    description="Unique id; part of the object name.")
    started_at: datetime = Field(description="When the nightly run started (timezone-aware, stored as UTC).")
    finished_at: datetime | None = Field(default=None, description="When it finished.")
    versions: Versions
    run_ids: dict[str, str] = Field(default_factory=dict, description="Run id of each mode's run, e.g. {'sft': ...}.")
    figures: dict[str, float] = Field(
        default_factory=dict,
        description="Flat figures keyed `<mode>.<figure>`; directions and tolerances are declared in FIGURES.")
    status: Literal["passed", "regression", "failed"] = Field(
        default="passed",
        description="passed; regression (the runs passed, a figure regressed); failed (a run failed or missed "
                    "its own checks). Failed nights are kept but never form a baseline.")

    @field_validator("started_at", "finished_at")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("timestamps must be timezone-aware (use datetime.now(timezone.utc))")
        return value.astimezone(UTC)

    @field_validator("figures")
    @classmethod
    def _figures(cls, value: dict[str, float]) -> dict[str, float]:
        for key, number in value.items():
            if not FIGURE_KEY.match(key):
                raise ValueError(f"figure key {key!r} must look like 'mode.figure' (lowercase, digits, '_', '.')")
            if not math.isfinite(number):
                raise ValueError(f"figure {key} is {number}; leave a figure out instead of recording a non-number")
        return value


def current_versions(checkout: str | Path | None = None) -> Versions:
    """Versions of skyrl-tx, tinker and jax installed here, and the git commit of the txflow checkout."""

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "unknown"

    commit = "unknown"
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout or Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", out.stdout.strip()):
            commit = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return Versions(skyrl_tx=installed("skyrl-tx"), tinker=installed("tinker"), jax=installed("jax"),
                    txflow_commit=commit)


def step_median(metrics: list[dict]) -> float | None:
    """Median seconds per step without the first step (it pays the JIT compile)."""
    seconds = [m["seconds"] for m in metrics[1:] if isinstance(m.get("seconds"), (int, float))]
    return statistics.median(seconds) if seconds else None


def figures_of(mode: str, values: dict[str, float | None]) -> dict[str, float]:
    """`{"<mode>.<name>": value}` for every finite value, e.g. figures_of("rl", {"median_step_s": 4.1})."""
    return {f"{mode}.{name}": float(v) for name, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def now() -> datetime:
    return datetime.now(UTC)
