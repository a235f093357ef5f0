"""discover-artifacts and `txflow discover`: what a run really left in durable storage."""

from __future__ import annotations

from txflow.checkpoints.discovery import Artifact, discover
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.results import Discovered, Saved


def run(cfg: RunConfig, saved: Saved) -> Discovered:
    """List and check every artifact under the run root, write manifest.json, and fail when a checkpoint
    this run saved is missing, incomplete or uncommitted."""
    log = get_logger()
    discovered = Discovered.list_run_root(cfg.run_root, cfg.plain_storage_options())
    by_url = {a.url: a for a in discovered.artifacts}
    for ckpt in saved.checkpoints:
        found = by_url.get(ckpt.url)
        if found is None:
            raise FileNotFoundError(f"The {ckpt.kind} checkpoint this run saved is not in storage at {ckpt.url}")
        if not (found.complete and found.committed):
            raise RuntimeError(f"The {ckpt.kind} checkpoint at {ckpt.url} is not usable: "
                               f"{found.reason or 'not committed'}")
    for a in discovered.artifacts:
        log.info(f"{a.kind:8} {a.format:9} {'ok' if a.complete else 'INCOMPLETE'} {a.bytes:>10} B "
                 f"{a.files if a.files is not None else '-':>4} files {a.url}" + (f" ({a.reason})" if a.reason else ""))
    return discovered


def url(where: str, options: dict, require_commit: bool = False) -> list[Artifact]:
    """Every artifact under `where` (a run root, a checkpoints root, one checkpoint), checked."""
    return discover(where, options, require_commit=require_commit)
