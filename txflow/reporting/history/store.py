"""The history's store: one object per record under an fsspec root, never rewritten, each with a checksum
that tells a partial or damaged object on reading."""

from __future__ import annotations

import hashlib
import json

import fsspec
from pydantic import ValidationError

from txflow.reporting.history.record import NightlyRecord

FORMAT = 1
RECORDS_DIR = "records"


class HistoryError(RuntimeError):
    """A record could not be written; the message says where and why."""


def _canonical(record: NightlyRecord) -> str:
    return json.dumps(record.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def encode(record: NightlyRecord) -> bytes:
    """The object's bytes: the record with a checksum over its canonical JSON."""
    body = _canonical(record)
    envelope = {"format": FORMAT, "sha256": hashlib.sha256(body.encode()).hexdigest(), "record": json.loads(body)}
    return json.dumps(envelope, sort_keys=True, indent=1).encode()


def decode(data: bytes) -> NightlyRecord:
    """The record in an object's bytes; ValueError saying why when it is partial, damaged or foreign."""
    try:
        envelope = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not complete JSON ({len(data)} bytes; partly written?): {exc}") from None
    if not isinstance(envelope, dict) or set(envelope) != {"format", "sha256", "record"}:
        raise ValueError("not a history record envelope (format, sha256, record)")
    if envelope["format"] != FORMAT:
        raise ValueError(f"record format {envelope['format']!r}, this txflow reads format {FORMAT}")
    if not isinstance(envelope["record"], dict):
        raise ValueError("the record is not an object")
    body = json.dumps(envelope["record"], sort_keys=True, separators=(",", ":"))
    if hashlib.sha256(body.encode()).hexdigest() != envelope["sha256"]:
        raise ValueError("checksum mismatch: the record was changed or damaged after it was written")
    try:
        return NightlyRecord.model_validate(envelope["record"])
    except ValidationError as exc:
        raise ValueError(f"invalid record: {exc.error_count()} errors, first: {exc.errors()[0]['msg']}") from None


def object_name(record: NightlyRecord) -> str:
    """`records/<UTC start, sortable>-<id>.json`: names sort by time, and the id keeps them unique."""
    return f"{RECORDS_DIR}/{record.started_at:%Y%m%dT%H%M%S%fZ}-{record.id}.json"


def append(root: str, record: NightlyRecord, storage_options: dict | None = None) -> str:
    """Write `record` as a new object under `root` and read it back; returns its URL.

    Never overwrites: an existing object of the same name (the same id) is an error.
    """
    fs, base = fsspec.core.url_to_fs(root, **(storage_options or {}))
    path = f"{base.rstrip('/')}/{object_name(record)}"
    url = f"{root.rstrip('/')}/{object_name(record)}"
    data = encode(record)
    try:
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        if fs.exists(path):
            raise HistoryError(f"history record {url} exists already; a record id must be new")
        fs.pipe_file(path, data)
        if fs.cat_file(path) != data:
            raise HistoryError(f"history record {url} does not read back as written")
    except HistoryError:
        raise
    except Exception as exc:  # any backend error: the record is not safely stored
        raise HistoryError(f"cannot write history record {url}: {type(exc).__name__}: {exc}") from exc
    return url


def read(root: str, storage_options: dict | None = None) -> tuple[list[NightlyRecord], list[str]]:
    """Every readable record under `root`, oldest first, and one problem line per object skipped.

    A missing root is an empty history. An object that is partial, damaged, of another format or
    unreadable is named in `problems` with the reason, and skipped: it never fails the caller.
    """
    fs, base = fsspec.core.url_to_fs(root, **(storage_options or {}))
    directory = f"{base.rstrip('/')}/{RECORDS_DIR}"
    problems: list[str] = []
    try:
        paths = sorted(p for p in fs.find(directory) if p.endswith(".json"))
    except FileNotFoundError:
        return [], []
    records = []
    for path in paths:
        url = f"{root.rstrip('/')}/{RECORDS_DIR}/{path.rsplit('/', 1)[-1]}"
        try:
            records.append(decode(fs.cat_file(path)))
        except ValueError as exc:
            problems.append(f"{url}: skipped, {exc}")
        except Exception as exc:  # a read error of one object must not hide the others
            problems.append(f"{url}: skipped, cannot read it ({type(exc).__name__}: {exc})")
    records.sort(key=lambda r: (r.started_at, r.id))
    return records, problems
