"""Commit markers: the sidecar `<artifact>.txflow-commit` written LAST when a checkpoint is made durable.

It records every file of the artifact with its size and MD5, in a canonical form (the same files give
the same bytes), so that discovery can tell a finished save from an interrupted or changed one, and,
where an object store lists MD5 ETags, from the listing alone.

MD5 only tells a changed byte from the committed one: whoever can write a file into the bucket can write
its marker too. With a signing key (`TXFLOW_SIGNING_KEY`, or the Prefect Secret block that
`TXFLOW_SIGNING_KEY_BLOCK` names) every marker also records the artifact's path below the checkpoint root
(`<run id>/<model id>/step-000020`, `<run id>/export/peft`, `promoted/<name>/history/<promotion id>/peft`)
and carries an HMAC-SHA256 of its record, that path included. A checkpoint is only read back (resume,
restore, export, promotion) when its marker is signed with that key and the path it was signed for is where
it is read from: a whole checkpoint root can move, one run's checkpoint cannot stand in for another's.
Without a key markers are unsigned, as before.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import posixpath
import re
import time

import fsspec

from txflow.checkpoints.names import is_txflow_state, step_of
from txflow.log import register_secret

COMMIT_SUFFIX = ".txflow-commit"
"""Sidecar written LAST by our save step, next to the artifact: `<artifact url>.txflow-commit`."""

# Sidecars of a deletion (`txflow.checkpoints.retention`): written first, while the artifact goes; and
# left when it has gone, saying when and why.
PRUNING_SUFFIX = ".txflow-pruning"
PRUNED_SUFFIX = ".txflow-pruned"
BEING_PRUNED = "being pruned: a prune stopped half-way (`txflow prune` finishes it)"

MD5_HEX = re.compile(r"[0-9a-f]{32}")
COMMIT_FORMAT = 3
# How the stored bytes of a committed artifact are known to be the committed ones, recorded in its marker:
# "etag": the store lists each file's MD5 as its ETag (S3 and its clones, single-part, no KMS or customer
# key), so the listing alone proves it; "read": they are read and hashed (a local disk; multipart uploads,
# whose ETag is no MD5; SSE-KMS or SSE-C, whose ETag is no MD5 of the content).
VERIFY_ETAG, VERIFY_READ = "etag", "read"

SIGNING_KEY_ENV = "TXFLOW_SIGNING_KEY"
SIGNING_KEY_BLOCK_ENV = "TXFLOW_SIGNING_KEY_BLOCK"
MIN_KEY_CHARS = 16


def md5_of(data_or_file) -> str:
    """MD5 hex digest of bytes or of a binary file object (read in chunks); a checksum, not security."""
    digest = hashlib.md5(usedforsecurity=False)
    if isinstance(data_or_file, bytes):
        digest.update(data_or_file)
    else:
        while chunk := data_or_file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def commit_record(files: dict[str, tuple[int, str]], verify: str = VERIFY_ETAG, path: str = "",
                  key: bytes | None = None) -> bytes:
    """The commit sidecar's content for an artifact of these files ({name: (size, md5)}): canonical (same
    files, same bytes), so that its MD5 can be checked against the ETag an object store lists. With a
    signing `key` it records the artifact's `path` below the checkpoint root (the run id included) and
    carries the HMAC of the record, so that a marker copied with its files under another run's or another
    checkpoint's path does not verify there."""
    record = {"format": COMMIT_FORMAT, "verify": verify, "bytes": sum(size for size, _ in files.values()),
              "files": {file: {"md5": md5, "size": size} for file, (size, md5) in sorted(files.items())}}
    if key is not None:
        record["path"] = path.strip("/")
        record["hmac"] = _mac(key, record)
    return _canonical(record)


def _canonical(record: dict) -> bytes:
    return json.dumps(record, indent=1, sort_keys=True).encode()


def _mac(key: bytes, record: dict) -> str:
    return hmac.new(key, _canonical(record), hashlib.sha256).hexdigest()


def read_commit(content: bytes) -> dict[str, tuple[int, str | None]]:
    """{name: (size, md5)} recorded in a commit sidecar; md5 is None in the sizes-only format 1. Raises
    ValueError for a marker that records no file (it would certify anything) or a name that is not a plain
    relative path inside the artifact."""
    files = json.loads(content)["files"]
    if not files:
        raise ValueError("the commit marker records no file")
    return {check_name(name): (entry, None) if isinstance(entry, int) else (int(entry["size"]), str(entry["md5"]))
            for name, entry in files.items()}


def check_name(name: str) -> str:
    """`name` when it is a plain relative path (no `..`, `.` or empty segment, not absolute), else ValueError:
    a file is only ever read back inside the directory it is copied to."""
    if any(part in ("", ".", "..") for part in name.split("/")) or "\\" in name or "\0" in name:
        raise ValueError(f"the commit marker records {name!r}, which is not a plain relative path inside the "
                         f"checkpoint")
    return name


def verify_method(content: bytes) -> str:
    """How a marker says its files are verified; markers before format 3 relied on MD5 ETags where listed."""
    return json.loads(content).get("verify", VERIFY_ETAG)


def signing_key() -> bytes | None:
    """The key commit markers are signed with: `TXFLOW_SIGNING_KEY`, else the Prefect Secret block that
    `TXFLOW_SIGNING_KEY_BLOCK` names; None when neither is set. Registered as a secret: never logged.
    Raises ValueError for a key shorter than 16 characters or a block that cannot be read."""
    value = os.environ.get(SIGNING_KEY_ENV) or None
    block = os.environ.get(SIGNING_KEY_BLOCK_ENV)
    if value is None and block:
        value = _secret_block(block)
    if value is None:
        return None
    register_secret(value)
    if len(value) < MIN_KEY_CHARS:
        raise ValueError(f"the commit signing key ({SIGNING_KEY_ENV} or {SIGNING_KEY_BLOCK_ENV}) has "
                         f"{len(value)} characters; use at least {MIN_KEY_CHARS} random ones")
    return value.encode()


@functools.cache
def _secret_block(name: str) -> str:
    from prefect.blocks.system import Secret

    try:
        return str(Secret.load(name).get())
    except Exception as exc:  # missing block, no Prefect API: the run must not go on unsigned
        raise ValueError(f"{SIGNING_KEY_BLOCK_ENV}={name}: cannot read that Prefect Secret block "
                         f"({type(exc).__name__}: {exc})") from None


def check_signature(content: bytes, stored_at: str, key: bytes | None, what: str) -> None:
    """With a signing `key`, raise ValueError unless the marker `content` of the artifact stored at the path
    `stored_at` (no protocol) is signed with it, for a path that `stored_at` ends with; `what` names the
    checkpoint in the message. Without a key, any marker passes."""
    if key is None:
        return
    record = json.loads(content)
    mac = record.pop("hmac", None)
    if not isinstance(mac, str):
        raise ValueError(f"{what}: its commit marker is not signed, and a signing key is set ({SIGNING_KEY_ENV}): "
                         f"it was not committed by a run with this key; refusing to read it")
    signed_for = record.get("path")
    if not isinstance(signed_for, str) or not signed_for:
        raise ValueError(f"{what}: its commit marker is signed for its last name only (by a txflow before "
                         f"signatures bound the path), so another run's checkpoint could stand in for it; "
                         f"refusing to read it")
    _check_mac(record, mac, signed_for, stored_at, key, f"{what}: its commit marker is")


def _check_mac(record: dict, mac: str, signed_for: str, stored_at: str, key: bytes, subject: str) -> None:
    """ValueError, its message starting with `subject`, unless `record` (its HMAC taken out) is signed with
    `key` for the path `signed_for`, and `stored_at` ends with that path."""
    if not hmac.compare_digest(mac, _mac(key, record)):
        raise ValueError(f"{subject} signed with another key, or was changed after it was signed; refusing to "
                         f"read it")
    if not stored_under(stored_at, signed_for):
        raise ValueError(f"{subject} signed for {signed_for!r}, not for where it is stored "
                         f"({stored_at.strip('/')!r}): a copy or move from another run or promotion is not this "
                         f"one; refusing to read it")


def stored_under(stored_at: str, signed_for: str) -> bool:
    """True when the path `stored_at` ends with the path `signed_for`, segment by segment: the artifact is
    where it was signed, below a checkpoint root that may have moved."""
    return f"/{stored_at.strip('/')}".endswith(f"/{signed_for.strip('/')}")


def signed_document(document: dict, path: str, key: bytes | None) -> bytes:
    """A JSON document (a promotion's pointer or record) as written: with a signing `key`, it records `path`,
    where it is written below the checkpoint root, and the HMAC of both; without one, as it is."""
    if key is None:
        return json.dumps(document, indent=1).encode()
    signed = {**document, "signed_path": path.strip("/")}
    return _canonical({**signed, "hmac": _mac(key, signed)})


def read_signed_document(content: bytes, stored_at: str, key: bytes | None, what: str) -> dict:
    """The document `content` read from the path `stored_at` (no protocol); with a signing `key`, ValueError
    unless it is signed with it for a path `stored_at` ends with. The signature's fields are removed."""
    document = json.loads(content)
    if not isinstance(document, dict):
        raise ValueError(f"{what}: not a JSON object")
    mac, signed_for = document.pop("hmac", None), document.get("signed_path")
    if key is None:
        document.pop("signed_path", None)
        return document
    if not isinstance(mac, str) or not isinstance(signed_for, str):
        raise ValueError(f"{what}: it is not signed, and a signing key is set ({SIGNING_KEY_ENV}): it was not "
                         f"written by a promotion with this key; refusing to read it")
    _check_mac(document, mac, signed_for, stored_at, key, f"{what}: it is")
    document.pop("signed_path")
    return document


def pruning_record(path: str, size: int, reason: str, key: bytes | None) -> bytes:
    """The `.txflow-pruning` sidecar a deletion of the artifact at `path` (no protocol) begins with: what it
    deletes (its path and step), when, how many bytes and why; signed for its own path with a key."""
    path = path.rstrip("/")
    return signed_document({"path": path.strip("/"), "step": step_of(path), "pruned_at": time.time(),
                            "bytes": size, "reason": reason}, path + PRUNING_SUFFIX, key)


def begun_prune(fs, path: str, key: bytes | None) -> tuple[dict | None, str | None]:
    """The record of a prune txflow began on the state checkpoint at `path` (no protocol), from its
    `.txflow-pruning` sidecar: (record, None) when the sidecar is one a deletion of exactly this checkpoint
    wrote (its path and step, a txflow state's name, signed with the key when one is set); (None, why) when
    a sidecar is there but is not that (a file anyone could have put there deletes nothing); (None, None)
    when there is none."""
    path = path.rstrip("/")
    sidecar = path + PRUNING_SUFFIX
    try:
        content = fs.cat_file(sidecar)
    except FileNotFoundError:
        return None, None
    try:
        record = read_signed_document(content, sidecar, key, sidecar)
    except ValueError as exc:
        return None, str(exc)
    step = step_of(path)
    if step is None or not is_txflow_state(path) or record.get("path") != path.strip("/") \
            or record.get("step") != step:
        return None, (f"{sidecar} does not record a deletion of this state checkpoint (its path and step "
                      f"{step}); ignored, nothing is deleted for it")
    return record, None


def write_commit(fs_url: str, storage_options: dict | None = None,
                 expected: dict[str, tuple[int, str]] | None = None, signed_as: str | None = None) -> str:
    """Write the commit sidecar `fs_url + COMMIT_SUFFIX` for the artifact at `fs_url`; returns how its files
    are verified (`VERIFY_ETAG` or `VERIFY_READ`).

    Call it LAST in a save step: the sidecar records every file of the artifact
    (a directory or a single file) with its size and MD5, so `discover` can tell
    a finished save from one that was interrupted or later changed. With
    `expected` ({relative path: (size, md5)} of what was uploaded), every file
    must be listed with its size, and its content must have that MD5: shown by
    its ETag where the store lists the MD5 as ETag, else, on an object store, by
    reading it back (an ETag that is no MD5: multipart, SSE-KMS, SSE-C); anything
    else raises instead of committing. Without `expected` the digests are
    computed from the stored files. With a signing key the marker is signed for
    `signed_as`, the artifact's path below its checkpoint root (default: its whole path).
    """
    fs, path = fsspec.core.url_to_fs(fs_url, **(storage_options or {}))
    path = path.rstrip("/")
    found = {p: info for p, info in fs.find(path, detail=True).items() if info.get("type", "file") == "file"}
    if not found:
        raise FileNotFoundError(f"Nothing was found at {fs_url!r} to commit.")
    if len(found) == 1 and same_path(next(iter(found)), path):
        listed = {posixpath.basename(path): (next(iter(found)), next(iter(found.values())))}
    else:
        listed = {relpath(p, path): (p, info) for p, info in found.items()}
    if expected is None:
        files = {}
        for name, (fs_path, info) in listed.items():
            with fs.open(fs_path, "rb") as f:
                files[name] = (listed_size(info), md5_of(f))
        verify = VERIFY_READ
    else:
        problems = sorted(set(expected) ^ set(listed))
        local = "file" in fs.protocol or "local" in fs.protocol
        by_etag = True
        for name in sorted(set(expected) & set(listed)):
            fs_path, info = listed[name]
            if listed_size(info) != expected[name][0]:
                problems.append(name)
            elif md5_etag(info) != expected[name][1]:
                by_etag = False
                if not local:  # the listing cannot show the content is right: read it back
                    with fs.open(fs_path, "rb") as f:
                        if md5_of(f) != expected[name][1]:
                            problems.append(name)
        if problems:
            raise OSError(f"Upload to {fs_url} is incomplete ({problems[:3]} missing, extra, of the wrong size or "
                          f"of other content); no commit marker written")
        files, verify = expected, VERIFY_ETAG if by_etag else VERIFY_READ
    fs.pipe_file(path + COMMIT_SUFFIX, commit_record(files, verify, signed_as or path, signing_key()))
    return verify


def md5_etag(info: dict) -> str | None:
    """The listed ETag when it can be the MD5 of the content: 32 hex digits (a multipart ETag is not; an
    SSE-KMS or SSE-C one is, without being the MD5: the marker's `verify` says which to trust)."""
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"').lower()
    return etag if MD5_HEX.fullmatch(etag) else None


def relpath(path: str, base: str) -> str:
    # Compare without leading slashes: memory:// paths come back as "/root/..."
    # while s3 paths come back as "bucket/..." (no protocol).
    path, base = path.strip("/"), base.strip("/")
    return path[len(base) :].lstrip("/") if base else path


def same_path(a: str, b: str) -> bool:
    return a.strip("/") == b.strip("/")


def listed_size(info: dict) -> int:
    return int(info.get("size") or 0)
