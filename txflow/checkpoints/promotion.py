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
and nothing it may be reading is deleted under it: a directory goes only once
the pointer has moved past it 6 times, followed through the pointer's own
history (each record's `previous`, the promotion the pointer named before),
never by ids, which are the wall-clock times of whichever machine promoted.
So a directory the pointer never named (a promotion still uploading, or one
that failed half-way) is never deleted by a trim. A promotion that fails
half-way leaves the pointer as it was; its partial directory is never pointed
at. Two promotions of one name at once: the later pointer write wins, both
directories stay. A trim that fails after the pointer moved leaves the
promotion standing (it is reported); the next trim finishes it.
"""

from __future__ import annotations

import os
import re
import secrets
import tempfile
import time
from pathlib import Path

import fsspec
from pydantic import BaseModel

from txflow.checkpoints import retention, storage
from txflow.checkpoints.markers import read_signed_document, signed_document, signing_key
from txflow.config import PROMOTED_DIR, checked_promotion_name
from txflow.log import get_logger

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
    approver: str | None = None  # who answered the approval (`txflow.artifacts.promote.approver`); None without one
    removed: list[str] = []  # promotions older than the 5 kept, deleted after the pointer moved
    trim_error: str | None = None  # the pointer moved, deleting older ones failed: the next trim does it


def root_of(checkpoints: str, name: str) -> str:
    """`<checkpoints>/promoted/<name>`; ValueError for a name that is not one (it becomes a path)."""
    return f"{checkpoints.rstrip('/')}/{PROMOTED_DIR}/{checked_promotion_name(name)}"


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
            storage.upload(local, f"{target}/{part}", options, f"the {part} export of {run_id}",
                           signed_as=f"{PROMOTED_DIR}/{name}/{HISTORY}/{promotion_id}/{part}")
    previous = current(checkpoints, name, options)
    full = {**record, "name": name, "id": promotion_id, "run_id": run_id, "promoted_at": time.time(),
            "files": {part: f"{target}/{part}" for part in exported},
            "previous": previous["id"] if previous else None}
    fs, path = fsspec.core.url_to_fs(base, **options)
    key, below = signing_key(), f"{PROMOTED_DIR}/{name}"  # signed for their paths below the checkpoint root
    fs.pipe_file(f"{path}/{HISTORY}/{promotion_id}/{RECORD}",
                 signed_document(full, f"{below}/{HISTORY}/{promotion_id}/{RECORD}", key))
    _replace(fs, f"{path}/{POINTER}", signed_document(
        {"id": promotion_id, "path": f"{HISTORY}/{promotion_id}", "run_id": run_id,
         "promoted_at": full["promoted_at"]}, f"{below}/{POINTER}", key))
    removed, trim_error = [], None
    try:
        removed = trim(checkpoints, name, options)
    except Exception as exc:  # the pointer moved: this promotion stands, whatever the older ones' fate
        trim_error = f"{type(exc).__name__}: {exc}"
        get_logger().warning(f"promoted {promotion_id} as {name!r}, but deleting older promotions failed "
                             f"({trim_error}); the next promotion or `txflow prune` deletes them")
    return Promotion(name=name, status="promoted", id=promotion_id, url=target, pointer=f"{base}/{POINTER}",
                     removed=removed, trim_error=trim_error)


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
    """The current promotion's record (`promotion.json`, with `url`), or None when there is none.

    What serving reads is checked before it is returned: the pointer names a promotion under
    `<root>/promoted/<name>/history/` (never `..`, an absolute path or another URL), the record's files are
    that promotion's own, and, with a signing key, the pointer and the record are signed for where they are
    and each file's commit marker is signed for its path. Raises ValueError naming what is wrong."""
    options = storage_options or {}
    base = root_of(checkpoints, name)
    fs, path = fsspec.core.url_to_fs(base, **options)
    key = signing_key()
    try:
        content = fs.cat_file(f"{path}/{POINTER}")
    except FileNotFoundError:
        return None
    pointer = read_signed_document(content, f"{path}/{POINTER}", key, f"{base}/{POINTER}")
    promotion_id = pointer.get("id")
    if not isinstance(promotion_id, str) or not re.fullmatch(r"[0-9A-Za-z][0-9A-Za-z._-]*", promotion_id) \
            or pointer.get("path") != f"{HISTORY}/{promotion_id}":
        raise ValueError(f"{base}/{POINTER} points at {pointer.get('path')!r}, not at a promotion under "
                         f"{base}/{HISTORY}/; refusing to follow it")
    record = _record(fs, path, base, promotion_id, key)
    url = f"{base}/{HISTORY}/{promotion_id}"
    files = record.get("files")
    # Each part is this promotion's own directory, wherever the root has moved since: the record's own
    # spelling of it is checked, never followed.
    below = f"/{PROMOTED_DIR}/{name}/{HISTORY}/{promotion_id}/"
    if record.get("id") != promotion_id or not isinstance(files, dict) or not files or any(
            not isinstance(part, str) or part not in ("peft", "merged") or not isinstance(file, str)
            or not file.endswith(below + part) or ".." in file.split("/") for part, file in files.items()):
        raise ValueError(f"{url}/{RECORD} names files {files!r}, not this promotion's own ({url}/<part>); "
                         f"refusing to serve them")
    record["files"] = {part: f"{url}/{part}" for part in files}
    for file in record["files"].values():
        storage.check_signed(file, options)  # with a key, each part's marker is signed for its path
    return {**record, "url": url}


def _record(fs, path: str, base: str, promotion_id: str, key: bytes | None) -> dict:
    """The record `history/<promotion_id>/promotion.json`; with a signing key, only when it is signed for
    that path."""
    stored = f"{path}/{HISTORY}/{promotion_id}/{RECORD}"
    return read_signed_document(fs.cat_file(stored), stored, key, f"{base}/{HISTORY}/{promotion_id}/{RECORD}")


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
            records.append(_record(fs, path, root_of(checkpoints, name), promotion_id, signing_key()))
        except FileNotFoundError:  # unfinished (a promotion that failed half-way): never current
            continue
    return records


def trim(checkpoints: str, name: str, storage_options: dict | None = None) -> list[str]:
    """Delete the promotions the pointer moved past more than `KEEP_PREVIOUS` times; returns their URLs.

    The pointer's history is followed from the current promotion through each record's `previous`: the
    current one and the `KEEP_PREVIOUS` before it stay, and a directory that is not in that history (a
    promotion in flight, or one that failed half-way) is never touched. The oldest goes first, each part as
    every deletion does (marker first), its record last: a trim that stopped leaves the history intact up to
    where it stopped, and the next trim finishes it."""
    options = storage_options or {}
    pointed = current(checkpoints, name, options)
    if pointed is None:
        return []
    fs, path = fsspec.core.url_to_fs(root_of(checkpoints, name), **options)
    listed = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(f"{path}/{HISTORY}", detail=False)}
    before, record = [], pointed
    # Only ids listed under history/ (a record names a directory there, nothing else), each once.
    while (previous := record.get("previous")) in listed and previous not in before and previous != pointed["id"]:
        try:
            record = _record(fs, path, root_of(checkpoints, name), previous, signing_key())
        except FileNotFoundError:  # trimmed already: everything older went before it
            break
        before.append(previous)
    removed = []
    for promotion_id in reversed(before[KEEP_PREVIOUS:]):
        url = f"{root_of(checkpoints, name)}/{HISTORY}/{promotion_id}"
        directory = f"{path}/{HISTORY}/{promotion_id}"
        for part in ("peft", "merged"):
            if fs.exists(f"{directory}/{part}"):
                retention.delete(f"{url}/{part}", options, reason="an older promotion", size=0)
        fs.rm(directory, recursive=True)
        removed.append(url)
    return removed


def trim_all(checkpoints: str, storage_options: dict | None = None) -> list[str]:
    """`trim` every promotion name under the checkpoints root (`txflow prune` finishes a trim that failed)."""
    fs, path = fsspec.core.url_to_fs(f"{checkpoints.rstrip('/')}/{PROMOTED_DIR}", **(storage_options or {}))
    if not fs.exists(path):
        return []
    return [url for name in fs.ls(path, detail=False)
            for url in trim(checkpoints, name.rstrip("/").rsplit("/", 1)[-1], storage_options)]


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
