"""What the pipeline steps hand each other, typed.

train -> `Trained`; save-checkpoint -> `Saved`; discover-artifacts ->
`Discovered`; evaluate-restore -> `RestoreCheck`; export-adapter -> `ExportResult`
(`txflow.checkpoints.export`). The report is built from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from txflow.checkpoints.discovery import Artifact
from txflow.checkpoints.export import ExportReference, ExportResult


class Checkpoint(BaseModel):
    """A checkpoint the run saved and committed to its durable root."""

    kind: Literal["state", "sampler"]
    tinker_path: str
    url: str
    saved_at: float | None = Field(default=None, description="When the engine wrote it (custom mode: which is last)")


@dataclass(eq=False)
class Trained:
    """The train step's outcome; the live training client stays usable on the cluster it ran on."""

    metrics: list[dict]
    final_state: Checkpoint | None  # committed at the last step (None in custom mode)
    resumed_from_step: int = 0
    client_runs: int = 0  # custom mode: how many times the user's client ran (a fault re-runs it)
    training_client: Any = None
    handle: Any = None  # the ClusterHandle the training client belongs to


class LiveReference(BaseModel):
    """What the live model gave before anything was restored; evaluate-restore must reproduce it."""

    eval_loss: float
    greedy_tokens: list[list[int]]
    base_tokens: list[list[int]] = Field(description="The base model's greedy tokens on the same prompts")
    prompts: list[list[int]]
    examples: list[tuple[list[int], list[float]]]
    from_committed_state: bool = Field(
        default=False, description="Taken on a fresh cluster from the committed final state, after a fault")


class Saved(BaseModel):
    checkpoints: list[Checkpoint]
    live: LiveReference | None = None  # None in custom mode


class Discovered(BaseModel):
    manifest: str
    artifacts: list[Artifact]


class RestoreCheck(BaseModel):
    """evaluate-restore's verdict: the restored model reproduces the live one, and the mode's quality bar."""

    passed: bool
    loss_before: float | None = None
    loss_after: float | None = None
    abs_diff: float | None = None
    sampler_tokens_match: bool | None = None
    tokens_differ_from_base: bool | None = None  # else matching tokens would prove nothing
    live_tokens: list[list[int]] | None = None
    restored_tokens: list[list[int]] | None = None
    quality: dict[str, float | bool] = Field(default_factory=dict, description="The mode's quality figures")
    checks: list[dict] | None = None  # custom mode: one per client checkpoint
    reference: ExportReference | None = Field(default=None, description="What the export must reproduce")
    failed_checks: list[str] = Field(default_factory=list,
                                     description="Each check missed, with the value found and its bound")

    def as_report(self) -> dict:
        """The report's `restore` block: the quality figures flattened in, absent fields left out."""
        return {**self.model_dump(exclude_none=True, exclude={"quality", "reference"}), **self.quality}


class Exported(BaseModel):
    """export-adapter's outcome, and the run root listed again with the export in it."""

    result: ExportResult
    discovered: Discovered
