"""Keep only what is needed: delete periodic state checkpoints, safely, on any fsspec store.

A deletion can stop anywhere (a SIGKILL, a lost connection), so it goes in an
order whose every prefix reads right:

1. `<artifact>.txflow-pruning` is written: the artifact is going (discovery
   reports it incomplete from now on, and `txflow prune` finishes it);
2. the commit marker is deleted: without it nothing takes the artifact for a
   complete checkpoint, whatever part of its data is left;
3. the data is deleted;
4. `<artifact>.txflow-pruned` (when, how many bytes, why) replaces the
   `.txflow-pruning` sidecar: a later `--resume-from` of that checkpoint is
   told it was pruned, and which state is the newest still there.

What is deleted: the periodic states of a run (`step-NNNNNN`), beyond the
newest `keep_last` and, with `older_than_s`, only those older than that. Never
the run's final state (its highest step), its sampler checkpoints, anything
exported, anything a promotion was made from, a custom client's checkpoints
(named by the client, so not txflow's to judge), nor anything of a run that
is still running (a live `lease.json`). Failed and unfinished runs are left
alone unless asked for: their newest state is what a resume needs, and it
always stays anyway.
"""

from __future__ import annotations

import json
import time
from typing import Literal

import fsspec
from pydantic import BaseModel

from txflow.checkpoints import lease
from txflow.checkpoints.discovery import Artifact, discover
from txflow.checkpoints.markers import (
    BEING_PRUNED,
    COMMIT_SUFFIX,
    PRUNED_SUFFIX,
    PRUNING_SUFFIX,
    begun_prune,
    pruning_record,
    signing_key,
)
from txflow.checkpoints.names import is_txflow_state, step_of
from txflow.config import RESERVED_RUN_IDS
from txflow.log import get_logger

REPORT = "report.json"


class Deletion(BaseModel):
    """One checkpoint that goes (or went), with why."""

    url: str
    step: int | None
    bytes: int
    reason: str


class RunPrune(BaseModel):
    """What a prune did (or, dry, would do) to one run."""

    run_id: str
    status: Literal["passed", "failed", "unfinished", "running"]
    skipped: str | None = None  # why the run was left alone
    deletions: list[Deletion] = []

    @property
    def bytes_freed(self) -> int:
        return sum(d.bytes for d in self.deletions)


def plan(artifacts: list[Artifact], keep_last: int | None, older_than_s: float | None = None,
         ages: dict[str, float] | None = None, protected: set[str] = frozenset()) -> list[Deletion]:
    """The deletions retention makes among one run's `artifacts` (from `discover`, with
    `.txflow-pruning` leftovers among them): leftovers always; the periodic states beyond the newest
    `keep_last` (all of them when None) and, with `older_than_s`, older than that (`ages`: seconds since
    each one's commit, by URL). Never the final state (highest step) nor a URL in `protected`."""
    deletions = [Deletion(url=a.url, step=step_of(a.path), bytes=a.bytes, reason="a prune stopped half-way")
                 for a in artifacts if a.reason == BEING_PRUNED]
    states = sorted((a for a in artifacts if a.kind == "state" and a.reason != BEING_PRUNED
                     and a.complete and a.committed and step_of(a.path) is not None and is_txflow_state(a.path)),
                    key=lambda a: step_of(a.path), reverse=True)
    if not states:
        return deletions
    final, periodic = states[0], states[1:]
    for rank, artifact in enumerate(periodic):
        if artifact.url in protected or artifact.url == final.url:
            continue
        if keep_last is not None and rank < keep_last:
            continue
        age = (ages or {}).get(artifact.url)
        if older_than_s is not None and (age is None or age < older_than_s):
            continue
        why = [f"beyond the newest {keep_last} periodic states" if keep_last is not None else None,
               f"older than {older_than_s / 86400:g} days" if older_than_s is not None else None]
        deletions.append(Deletion(url=artifact.url, step=step_of(artifact.path), bytes=artifact.bytes,
                                  reason=", ".join(w for w in why if w)))
    return sorted(deletions, key=lambda d: (d.step is None, d.step or 0))


def delete(url: str, storage_options: dict | None = None, *, reason: str, size: int) -> None:
    """Delete the committed artifact at `url` in the order the module docstring gives."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    path = path.rstrip("/")
    key = signing_key()
    if begun_prune(fs, path, key)[0] is not None:  # an earlier prune began it: finish it under its own record
        record = fs.cat_file(path + PRUNING_SUFFIX)
    else:
        record = pruning_record(path, size, reason, key)
        fs.pipe_file(path + PRUNING_SUFFIX, record)
    if fs.exists(path + COMMIT_SUFFIX):
        fs.rm_file(path + COMMIT_SUFFIX)
    if fs.exists(path):
        fs.rm(path, recursive=True)
    fs.pipe_file(path + PRUNED_SUFFIX, record)
    fs.rm_file(path + PRUNING_SUFFIX)


def pruned_record(url: str, storage_options: dict | None = None) -> dict | None:
    """When the checkpoint at `url` was pruned (its `.txflow-pruned` record), or None."""
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    try:
        return json.loads(fs.cat_file(path.rstrip("/") + PRUNED_SUFFIX))
    except FileNotFoundError:
        return None


def apply(run_root: str, artifacts: list[Artifact], keep_last: int, storage_options: dict | None = None,
          protected: set[str] = frozenset()) -> list[Deletion]:
    """A passed run's own retention (`keep_last`): delete what `plan` says; returns the deletions."""
    deletions = plan(artifacts, keep_last, protected=protected)
    for deletion in deletions:
        delete(deletion.url, storage_options, reason=deletion.reason, size=deletion.bytes)
    return deletions


def runs_under(root: str, storage_options: dict | None = None) -> list[str]:
    """The run roots directly under the checkpoints `root` (directories that are not promotions or the
    nightly history). Raises ValueError when `root` is itself a run root or holds no run."""
    fs, path = fsspec.core.url_to_fs(root, **(storage_options or {}))
    path = path.rstrip("/")
    if not fs.isdir(path):
        raise ValueError(f"{root} is not a checkpoints root: nothing is there")
    if _is_run(fs, path):
        raise ValueError(f"{root} is one run's root; give the checkpoints root above it (--checkpoints)")
    runs = sorted(info["name"].rstrip("/").rsplit("/", 1)[-1] for info in fs.ls(path, detail=True)
                  if info["type"] == "directory")
    runs = [r for r in runs if r not in RESERVED_RUN_IDS and _is_run(fs, f"{path}/{r}")]
    if not runs:
        raise ValueError(f"{root} is not a checkpoints root: it holds no run directories")
    return [f"{root.rstrip('/')}/{r}" for r in runs]


def _is_run(fs, path: str) -> bool:
    """A run's root: its report or lease, or txflow's states under a model's directory (a run that died)."""
    return (fs.exists(f"{path}/{REPORT}") or fs.exists(f"{path}/{lease.LEASE}")
            or bool(fs.glob(f"{path}/*/step-*")))


def run_status(run_root: str, storage_options: dict | None = None) -> str:
    """passed or failed (its report), running (a live lease), or unfinished (neither)."""
    if lease.alive(run_root, storage_options):
        return "running"
    fs, path = fsspec.core.url_to_fs(run_root, **(storage_options or {}))
    try:
        return json.loads(fs.cat_file(f"{path.rstrip('/')}/{REPORT}"))["status"]
    except FileNotFoundError:
        return "unfinished"


def prune(root: str, keep_last: int | None, older_than_days: float | None, *, dry_run: bool = False,
          include_failed: bool = False, protected: set[str] = frozenset(),
          storage_options: dict | None = None) -> list[RunPrune]:
    """`txflow prune`: retention over every run under the checkpoints `root`."""
    if keep_last is None and older_than_days is None:
        raise ValueError("say what to prune: --keep-last K, --older-than DAYS, or both")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"--keep-last must be at least 1 (the final state always stays), got {keep_last}")
    if older_than_days is not None and older_than_days < 0:
        raise ValueError(f"--older-than must be 0 days or more, got {older_than_days:g}")
    results = []
    for run_root in runs_under(root, storage_options):
        run_id = run_root.rsplit("/", 1)[-1]
        status = run_status(run_root, storage_options)
        result = RunPrune(run_id=run_id, status=status)
        results.append(result)
        if status == "running":
            result.skipped = "still running (a live lease.json): nothing of a running run is touched"
            continue
        if status != "passed" and not include_failed:
            result.skipped = f"{status}: left whole (--include-failed prunes it, its newest state kept)"
            continue
        try:
            artifacts = discover(run_root, storage_options, verify_tarballs=False)
        except FileNotFoundError:
            continue
        ages = _ages(artifacts, storage_options) if older_than_days is not None else None
        result.deletions = plan(artifacts, keep_last, None if older_than_days is None else older_than_days * 86400,
                                ages, protected) + _emptied(run_root, artifacts, storage_options)
        if not dry_run:
            for deletion in result.deletions:
                delete(deletion.url, storage_options, reason=deletion.reason, size=deletion.bytes)
    return results


def _emptied(run_root: str, artifacts: list[Artifact], storage_options: dict | None) -> list[Deletion]:
    """Deletions that stopped after the data went: a `.txflow-pruning` sidecar with nothing left beside it,
    which a deletion of that state checkpoint wrote (`begun_prune`); any other such file is named and left."""
    fs, root = fsspec.core.url_to_fs(run_root, **(storage_options or {}))
    present = {a.url.rstrip("/") for a in artifacts}
    key = signing_key()
    found = []
    for path in fs.find(root):
        if path.endswith(PRUNING_SUFFIX):
            url = f"{run_root.rstrip('/')}/{path.removesuffix(PRUNING_SUFFIX)[len(root.rstrip('/')) + 1:]}"
            if url in present:
                continue
            record, why = begun_prune(fs, path.removesuffix(PRUNING_SUFFIX), key)
            if record is None:
                get_logger().warning(f"prune: {why}")
                continue
            found.append(Deletion(url=url, step=step_of(url), bytes=0, reason="a prune stopped half-way"))
    return found


def _ages(artifacts: list[Artifact], storage_options: dict | None) -> dict[str, float]:
    """Seconds since each committed state's commit marker was written, by URL."""
    ages = {}
    now = time.time()
    for artifact in artifacts:
        if artifact.kind != "state" or not artifact.committed:
            continue
        fs, path = fsspec.core.url_to_fs(artifact.url, **(storage_options or {}))
        info = fs.info(path.rstrip("/") + COMMIT_SUFFIX)
        modified = info.get("LastModified") or info.get("mtime") or info.get("created")
        if hasattr(modified, "timestamp"):
            modified = modified.timestamp()
        if modified is not None:
            ages[artifact.url] = now - float(modified)
    return ages
