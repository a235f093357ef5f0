"""What the pipeline steps hand each other, typed.

train -> `Trained`; save-checkpoint -> `Saved`; discover-artifacts ->
`Discovered`; evaluate-restore -> `RestoreCheck`; export-adapter -> `ExportResult`
(`txflow.checkpoints.export`); prune-checkpoints -> `Pruned`; promote -> `Promotion`
(`txflow.checkpoints.promotion`). The report is built from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from txflow.checkpoints.discovery import Artifact, discover, write_manifest
from txflow.checkpoints.export import ExportReference, ExportResult
from txflow.checkpoints.retention import Deletion


class Checkpoint(BaseModel):
    """A checkpoint the run saved and committed to its durable root."""

    kind: Literal["state", "sampler"]
    tinker_path: str
    url: str
    saved_at: float | None = Field(default=None, description="When the engine wrote it (custom mode: which is last)")


class LiveReference(BaseModel):
    """What the live model gave at its last step, before its final state was committed: what every later
    step must reproduce from the durable copies (evaluate-restore, on any cluster and any attempt)."""

    eval_loss: float
    greedy_tokens: list[list[int]]
    base_tokens: list[list[int]] = Field(description="The base model's greedy tokens on the same prompts")
    prompts: list[list[int]]
    examples: list[tuple[list[int], list[float]]]
    logprobs: list[list[float]] = Field(default_factory=list,
                                        description="The live sampler's per-token logprobs of the examples")
    from_committed_state: bool = Field(
        default=False, description="Taken from the committed final state: no record of the live model was left "
        "(a run of an older txflow continued past its last step)")


@dataclass(eq=False)
class Trained:
    """The train step's outcome; the live training client stays usable on the cluster it ran on."""

    metrics: list[dict]
    final_state: Checkpoint | None  # committed at the last step (None in custom mode)
    resumed_from_step: int = 0
    client_runs: int = 0  # custom mode: how many times the user's client ran (a fault re-runs it)
    training_client: Any = None
    handle: Any = None  # the ClusterHandle the training client belongs to
    live: LiveReference | None = None  # the live model's figures, taken before its final commit (None in custom)


class Saved(BaseModel):
    checkpoints: list[Checkpoint]
    live: LiveReference | None = None  # None in custom mode


class Discovered(BaseModel):
    manifest: str
    artifacts: list[Artifact]

    @classmethod
    def list_run_root(cls, run_root: str, storage_options: dict | None) -> Discovered:
        """Every artifact under the run root as it is now (commit markers required), and its manifest
        written: what a step that changed the root hands on."""
        artifacts = discover(run_root, storage_options, require_commit=True)
        return cls(manifest=write_manifest(run_root, artifacts, storage_options), artifacts=artifacts)


class RestoreCheck(BaseModel):
    """evaluate-restore's verdict: the restored model reproduces the live one, and the mode's quality bar."""

    passed: bool
    loss_before: float | None = None
    loss_after: float | None = None
    abs_diff: float | None = None
    sampler_tokens_match: bool | None = None
    tokens_differ_from_base: bool | None = None  # else matching tokens would prove nothing
    sampler_logprob_diff: float | None = None  # restored sampler against the live model's, per token
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


class Pruned(BaseModel):
    """prune-checkpoints' outcome, and the run root listed again without what went."""

    keep_last: int
    deletions: list[Deletion]
    bytes_freed: int
    discovered: Discovered

    def as_report(self) -> dict:
        return {"keep_last": self.keep_last, "bytes_freed": self.bytes_freed,
                "deleted": [d.model_dump() for d in self.deletions]}
