"""Promotions: a fixed place that serving reads, which moves only when a run passed every check.

    <checkpoints>/promoted/<name>/
        current.json                  the pointer: which promotion is current; written LAST
        history/<id>/peft/            the exported PEFT adapter (committed, as in the run root)
        history/<id>/merged/          the merged model, when the run exported one
        history/<id>/promotion.json   run id, time, base model, figures, sources, versions

Object stores cannot rename a directory, so a promotion never changes files
in place: it writes a new `history/<id>/` directory whole (each part
committed with its markers, `promotion.json` last), and only then replaces
`current.json`, one object (one PUT on an object store, an atomic rename on a
local disk). A reader that reads the pointer first, then the directory it
names, sees the previous promotion whole or the new one whole, never a mix;
and nothing it may be reading is deleted under it, since a directory goes
only when 5 newer ones than it are kept. A promotion that fails half-way
leaves the pointer as it was; its partial directory is never pointed at.
Two promotions of one name at once: the later pointer write wins, both
directories stay.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from pathlib import Path

import fsspec
from pydantic import BaseModel

from txflow.checkpoints import retention, storage
from txflow.config import PROMOTED_DIR

POINTER = "current.json"
RECORD = "promotion.json"
HISTORY = "history"
KEEP_PREVIOUS = 5


class Promotion(BaseModel):
    """The outcome of the promote step, as the report shows it."""

    name: str
    status: str  # "promoted", "rejected", "not approved in time", "failed: ..."
    id: str | None = None
    url: str | None = None  # history/<id>/, where this promotion's files are
    pointer: str | None = None
    comment: str | None = None
    removed: list[str] = []  # promotions older than the 5 kept, deleted after the pointer moved


def root_of(checkpoints: str, name: str) -> str:
    return f"{checkpoints.rstrip('/')}/{PROMOTED_DIR}/{name}"


def new_id(run_id: str) -> str:
    """Sortable by time: the history's order."""
    now = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z-{run_id}"


def promote(checkpoints: str, name: str, run_id: str, exported: dict[str, str], record: dict,
            storage_options: dict | None = None, workdir: str | None = None) -> Promotion:
    """Publish the committed exports (`{"peft": url, "merged": url}`) of run `run_id` as promotion `name`:
    copy each, verified against its commit marker, into a new `history/<id>/`, write its record, then move
    the pointer; then delete what is older than the 5 promotions kept before this one."""
    options = storage_options or {}
    base = root_of(checkpoints, name)
    promotion_id = new_id(run_id)
    target = f"{base}/{HISTORY}/{promotion_id}"
    with tempfile.TemporaryDirectory(prefix="txflow-promote-", dir=workdir) as scratch:
        for part, url in exported.items():
            local = Path(scratch) / part
            storage.download(url, local, options, directory=True)  # refuses bytes that are not the committed ones
            storage.upload(local, f"{target}/{part}", options, f"the {part} export of {run_id}")
    previous = current(checkpoints, name, options)
    full = {**record, "name": name, "id": promotion_id, "run_id": run_id, "promoted_at": time.time(),
            "files": {part: f"{target}/{part}" for part in exported},
            "previous": previous["id"] if previous else None}
    fs, path = fsspec.core.url_to_fs(base, **options)
    fs.pipe_file(f"{path}/{HISTORY}/{promotion_id}/{RECORD}", json.dumps(full, indent=1).encode())
    _replace(fs, f"{path}/{POINTER}", json.dumps({"id": promotion_id, "path": f"{HISTORY}/{promotion_id}",
                                                  "run_id": run_id, "promoted_at": full["promoted_at"]}).encode())
    removed = trim(checkpoints, name, options)
    return Promotion(name=name, status="promoted", id=promotion_id, url=target, pointer=f"{base}/{POINTER}",
                     removed=removed)


def _replace(fs, path: str, data: bytes) -> None:
    """Replace one object whole: readers see the old content or the new, never part of either."""
    if "file" in fs.protocol or "local" in fs.protocol:
        fs.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{secrets.token_hex(4)}.tmp"
        fs.pipe_file(temporary, data)
        os.replace(temporary, path)  # a rename within one directory: atomic on POSIX
    else:
        fs.pipe_file(path, data)  # one PUT: object stores replace an object atomically


def current(checkpoints: str, name: str, storage_options: dict | None = None) -> dict | None:
    """The current promotion's record (`promotion.json`, with `url`), or None when there is none."""
    fs, path = fsspec.core.url_to_fs(root_of(checkpoints, name), **(storage_options or {}))
    try:
        pointer = json.loads(fs.cat_file(f"{path}/{POINTER}"))
    except FileNotFoundError:
        return None
    record = json.loads(fs.cat_file(f"{path}/{pointer['path']}/{RECORD}"))
    return {**record, "url": f"{root_of(checkpoints, name)}/{pointer['path']}"}


def history(checkpoints: str, name: str, storage_options: dict | None = None) -> list[dict]:
    """Every promotion of `name` still kept, newest first (records of finished ones)."""
    fs, path = fsspec.core.url_to_fs(root_of(checkpoints, name), **(storage_options or {}))
    try:
        ids = sorted((p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{path}/{HISTORY}", detail=False)),
                     reverse=True)
    except FileNotFoundError:
        return []
    records = []
    for promotion_id in ids:
        try:
            records.append(json.loads(fs.cat_file(f"{path}/{HISTORY}/{promotion_id}/{RECORD}")))
        except FileNotFoundError:  # unfinished (a promotion that failed half-way): never current
            continue
    return records


def trim(checkpoints: str, name: str, storage_options: dict | None = None) -> list[str]:
    """Delete the promotions older than the current one and the `KEEP_PREVIOUS` before it; returns their
    URLs. Each part goes as every deletion does (marker first), then the directory."""
    options = storage_options or {}
    pointed = current(checkpoints, name, options)
    if pointed is None:
        return []
    fs, path = fsspec.core.url_to_fs(root_of(checkpoints, name), **options)
    ids = sorted((p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{path}/{HISTORY}", detail=False)),
                 reverse=True)
    older = [i for i in ids if i < pointed["id"]]
    removed = []
    for promotion_id in older[KEEP_PREVIOUS:]:
        url = f"{root_of(checkpoints, name)}/{HISTORY}/{promotion_id}"
        directory = f"{path}/{HISTORY}/{promotion_id}"
        if fs.exists(f"{directory}/{RECORD}"):
            fs.rm_file(f"{directory}/{RECORD}")  # first: a reader of history no longer lists it
        for part in ("peft", "merged"):
            if fs.exists(f"{directory}/{part}"):
                retention.delete(f"{url}/{part}", options, reason="an older promotion", size=0)
        fs.rm(directory, recursive=True)
        removed.append(url)
    return removed


def sources(checkpoints: str, storage_options: dict | None = None) -> set[str]:
    """Every checkpoint URL a kept promotion (of any name) was made from: retention never deletes them."""
    fs, path = fsspec.core.url_to_fs(f"{checkpoints.rstrip('/')}/{PROMOTED_DIR}", **(storage_options or {}))
    if not fs.exists(path):
        return set()
    found = set()
    for name in fs.ls(path, detail=False):
        for record in history(checkpoints, name.rstrip("/").rsplit("/", 1)[-1], storage_options):
            found |= {url for url in (record.get("sources") or {}).values() if url}
    return found
