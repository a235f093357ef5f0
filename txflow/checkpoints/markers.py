"""Commit markers: the sidecar `<artifact>.txflow-commit` written LAST when a checkpoint is made durable.

It records every file of the artifact with its size and MD5, in a canonical form (the same files give
the same bytes), so that discovery can tell a finished save from an interrupted or changed one, and,
where an object store lists MD5 ETags, from the listing alone.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re

import fsspec

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


def md5_of(data_or_file) -> str:
    """MD5 hex digest of bytes or of a binary file object (read in chunks); a checksum, not security."""
    digest = hashlib.md5(usedforsecurity=False)
    if isinstance(data_or_file, bytes):
        digest.update(data_or_file)
    else:
        while chunk := data_or_file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def commit_record(files: dict[str, tuple[int, str]], verify: str = VERIFY_ETAG) -> bytes:
    """The commit sidecar's content for an artifact of these files ({name: (size, md5)}): canonical (same
    files, same bytes), so that its MD5 can be checked against the ETag an object store lists."""
    record = {"format": COMMIT_FORMAT, "verify": verify, "bytes": sum(size for size, _ in files.values()),
              "files": {name: {"md5": md5, "size": size} for name, (size, md5) in sorted(files.items())}}
    return json.dumps(record, indent=1, sort_keys=True).encode()


def read_commit(content: bytes) -> dict[str, tuple[int, str | None]]:
    """{name: (size, md5)} recorded in a commit sidecar; md5 is None in the sizes-only format 1."""
    files = json.loads(content)["files"]
    return {name: (entry, None) if isinstance(entry, int) else (int(entry["size"]), str(entry["md5"]))
            for name, entry in files.items()}


def verify_method(content: bytes) -> str:
    """How a marker says its files are verified; markers before format 3 relied on MD5 ETags where listed."""
    return json.loads(content).get("verify", VERIFY_ETAG)


def write_commit(fs_url: str, storage_options: dict | None = None,
                 expected: dict[str, tuple[int, str]] | None = None) -> str:
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
    computed from the stored files.
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
    fs.pipe_file(path + COMMIT_SUFFIX, commit_record(files, verify))
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
