"""One live run per run id: `<run_root>/lease.json`, created only where none is, renewed while the run lives.

Two runs with one run id would wipe each other's staging, resume from each
other's states, and the first to finish would mark the other's root passed.
So a run creates its lease exclusively: a conditional create where the store
offers one (S3's `If-None-Match: *`, s3fs `mode="create"`), a hard link that
fails when the name exists on a local disk (the content is whole before the
name appears); other stores check first (not atomic). A lease whose holder
still lives refuses the second run (`LeaseHeld`, naming the holder). A lease
whose holder is dead is taken over, with a log line: not renewed for `TTL_S`
(10 renewals missed), or, on this host, its process is gone.

`txflow prune` may run on another machine than the run, against the same
bucket, so a local `cluster.json` cannot tell it a run is still going. The
lease can: it names its holder and an expiry, renewed every `RENEW_S` while
the flow runs (an approval's wait included), and deleted when the run ends.
A run whose orchestrator died stops renewing it; after `TTL_S` the run counts
as unfinished, which prune leaves alone unless told `--include-failed`.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from contextlib import contextmanager

import fsspec

from txflow.log import get_logger
from txflow.processes.procfs import is_alive, start_time

LEASE = "lease.json"
RENEW_S = 60.0
TTL_S = 10 * RENEW_S


class LeaseHeld(ValueError):
    """Another run holds the run id's lease; the message names it."""


def _record(run_id: str, token: str, ttl_s: float) -> bytes:
    now = time.time()
    return json.dumps({"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
                       "started": start_time(os.getpid()), "token": token, "renewed_at": now,
                       "expires_at": now + ttl_s}).encode()


def _is_local(fs) -> bool:
    return "file" in fs.protocol or "local" in fs.protocol


def _create(fs, path: str, data: bytes) -> bool:
    """Write `data` at `path` only when nothing is there; False when something is."""
    try:
        if _is_local(fs):
            temporary = f"{path}.{secrets.token_hex(4)}.tmp"
            with open(temporary, "wb") as f:
                f.write(data)
            try:
                os.link(temporary, path)  # fails when the name exists; the file is whole before it appears
            finally:
                os.unlink(temporary)
        else:
            fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return False
    return True


def _replace(fs, path: str, data: bytes) -> None:
    if _is_local(fs):
        temporary = f"{path}.{secrets.token_hex(4)}.tmp"
        with open(temporary, "wb") as f:
            f.write(data)
        os.replace(temporary, path)  # readers see the old lease or the new, never part of one
    else:
        fs.pipe_file(path, data)  # one PUT


def _read(fs, path: str) -> dict | None:
    """The lease at `path`, None when there is none; {} when it is unreadable (no holder can be named)."""
    try:
        record = json.loads(fs.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def stale(record: dict) -> str | None:
    """Why the holder of lease `record` is dead, or None while it lives."""
    expires_at = record.get("expires_at")
    if not isinstance(expires_at, (int, float)):
        return "the lease is unreadable"
    if expires_at < time.time():
        return f"not renewed for {time.time() - float(record.get('renewed_at') or expires_at):.0f} s"
    pid = record.get("pid")
    if record.get("host") == socket.gethostname() and isinstance(pid, int) and not is_alive(pid, record.get("started")):
        return f"its process {pid} on this host is gone"
    return None


def describe(record: dict, run_root: str) -> str:
    """One line naming the live run that holds `record`."""
    age = time.time() - float(record.get("renewed_at") or time.time())
    return (f"Run {record.get('run_id')} is running under {run_root} (host {record.get('host')}, pid "
            f"{record.get('pid')}, lease renewed {age:.0f} s ago): one live run per run id. Wait for it to end, "
            f"or use another --run-id")


def holder(run_root: str, storage_options: dict | None = None) -> dict | None:
    """The lease of the live run under `run_root`, or None when no live run holds it."""
    fs, root = fsspec.core.url_to_fs(run_root, **(storage_options or {}))
    record = _read(fs, f"{root.rstrip('/')}/{LEASE}")
    return record if record is not None and stale(record) is None else None


def alive(run_root: str, storage_options: dict | None = None) -> bool:
    """Whether a live run holds `run_root`'s lease now."""
    return holder(run_root, storage_options) is not None


def _acquire(fs, path: str, run_root: str, run_id: str, token: str, ttl_s: float) -> None:
    """Create the lease; take it over from a dead holder; raise LeaseHeld when a live one has it."""
    for _ in range(3):  # a lease that vanishes or is taken over between two looks: look again
        if _create(fs, path, _record(run_id, token, ttl_s)):
            return
        record = _read(fs, path)
        if record is None:
            continue
        why = stale(record)
        if why is None:
            raise LeaseHeld(describe(record, run_root))
        get_logger().warning(f"taking over the lease of run {record.get('run_id')} under {run_root} (host "
                             f"{record.get('host')}, pid {record.get('pid')}): its holder is dead ({why})")
        try:
            fs.rm_file(path)
        except FileNotFoundError:
            pass
    raise LeaseHeld(f"Another run keeps taking the lease of {run_root} (run id {run_id}); use another --run-id")


@contextmanager
def held(run_root: str, run_id: str, storage_options: dict | None = None, ttl_s: float = TTL_S,
         renew_s: float = RENEW_S):
    """Hold the run's lease for the duration of the block. Raises LeaseHeld, before the block, when a live
    run holds it."""
    fs, root = fsspec.core.url_to_fs(run_root, **(storage_options or {}))
    fs.makedirs(root, exist_ok=True)
    path = f"{root.rstrip('/')}/{LEASE}"
    token = secrets.token_hex(16)
    _acquire(fs, path, run_root, run_id, token, ttl_s)
    stop = threading.Event()

    def renew():
        while not stop.wait(renew_s):
            try:
                record = _read(fs, path)
                if record is None or record.get("token") != token:
                    get_logger().error(f"run {run_id}: the lease of {run_root} was taken over (by run "
                                       f"{(record or {}).get('run_id')}); another run may use this run id now")
                    return
                _replace(fs, path, _record(run_id, token, ttl_s))
            except Exception:  # a store briefly away: the next renewal tries again, well within the TTL
                pass

    thread = threading.Thread(target=renew, name="txflow-lease", daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join()
        try:
            if (_read(fs, path) or {}).get("token") == token:  # never another run's lease
                fs.rm_file(path)
        except Exception:  # gone already, or the store away: the lease then expires on its own
            pass
