"""What the pipeline steps hand each other, typed, and the run's `Progress` that holds them.

train -> `Trained`; save-checkpoint -> `Saved`; discover-artifacts ->
`Discovered`; evaluate-restore -> `RestoreCheck`; export-adapter -> `Exported`;
prune-checkpoints -> `Pruned`; approval -> `Decision`; promote -> `Promotion`
(`txflow.checkpoints.promotion`). The report is built from `Progress`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from txflow.checkpoints.discovery import Artifact, discover, write_manifest
from txflow.checkpoints.export import ExportReference, ExportResult
from txflow.checkpoints.promotion import Promotion
from txflow.checkpoints.retention import Deletion
from txflow.cluster.monitor import Failure


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
                                        description="The live sampler's logprob of each token after the "
                                        "first of each prompt and its greedy tokens")
    shared_base_tokens: bool = Field(default=False, description="`base_tokens` are those another run on the "
                                     "same cluster took (`txflow.training.base_figures`)")


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
    answers: list[dict] | None = Field(default=None, description="Held-out prompts with the base model's and the "
                                       "trained model's greedy answers (and the expected one, where known)")
    reference: ExportReference | None = Field(default=None, description="What the export must reproduce")
    failed_checks: list[str] = Field(default_factory=list,
                                     description="Each check missed, with the value found and its bound")
    shared_base_figures: list[str] | None = Field(default=None, description="The base model's figures this run "
                                                  "took from another run on the same cluster, computed once "
                                                  "(`greedy_tokens`, `eval_loss`, `eval_rewards`)")

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


class Decision(BaseModel):
    """The approval's outcome: what the person answered, and who answered (`txflow.artifacts.promote.approver`)."""

    verdict: Literal["approved", "rejected", "not approved in time"]
    comment: str | None = None
    approver: str | None = None  # None when nobody answered


def step_name(step) -> str:
    """The name a step is known by in the UI, the timings and the report: a Prefect task's own name, else the
    function's name with dashes (`approval`)."""
    return getattr(step, "name", None) or step.__name__.replace("_", "-")


@dataclass
class Progress:
    """What the steps of one run have produced so far, the step running now and the seconds of each: a retry
    runs only the steps still missing, and the report is built from it."""

    trained: Trained | None = None
    saved: Saved | None = None
    discovered: Discovered | None = None
    restore: RestoreCheck | None = None
    evaluation: dict | None = None  # the evaluate step's scores (`txflow.serving.evaluation.report`)
    exported: Exported | None = None
    pruned: Pruned | None = None
    promoted: Promotion | None = None
    step: str | None = None  # the step running now, or the last one that ran
    train_runs: int = 0
    failures: list[Failure] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step; a step on several clusters adds up
    ranks: list[dict] = field(default_factory=list)  # each process of the last cluster, as teardown left it

    def run(self, step, *args, **kwargs):
        """Run `step` (a Prefect task or a function) as the run's current step, and time it."""
        self.step = step_name(step)
        return self.time(step, *args, **kwargs)

    def time(self, step, *args, **kwargs):
        """Run `step` and add its seconds to its timing, leaving the current step as it is (teardown)."""
        name = step_name(step)
        start = time.monotonic()
        try:
            return step(*args, **kwargs)
        finally:
            self.timings[name] = round(self.timings.get(name, 0.0) + time.monotonic() - start, 3)
