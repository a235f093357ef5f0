"""One live run per run id: `<run_root>/lease.json`, created only where none is, renewed while the run lives.

Two runs with one run id would wipe each other's staging, resume from each
other's states, and the first to finish would mark the other's root passed.
So a run creates its lease exclusively: a conditional create where the store
offers one (S3's `If-None-Match: *`, s3fs `mode="create"`), a hard link that
fails when the name exists on a local disk (the content is whole before the
name appears); other stores check first (not atomic). A lease whose holder
still lives refuses the second run (`LeaseHeld`, naming the holder). A lease
whose holder is dead is taken over, with a log line. On this host that is
known at once: its process is gone (a live one is never taken over, whatever
the clocks say). For a holder on another host, no clock is compared with
another machine's: a lease whose holder's own timestamp says it was renewed
within `TTL_S` refuses the second run at once (refusing is the safe mistake),
and one that looks older is watched, on the second run's own monotonic clock,
and taken over only when its bytes (its ETag on S3) stayed the same for
`TTL_S` (a live holder renews every `RENEW_S`, so it shows itself).

Every change to a lease that exists (a takeover, a renewal, the release) is
made only if the lease is still the one read: on S3 a write or delete with
`If-Match` its ETag, on a local disk under an exclusive `flock` of the run
root. So of two runs taking over one dead lease at once, one wins and the
other is refused like any second run; and a holder that was taken over (it
looked dead: it stopped renewing for `TTL_S`) finds out at its next renewal,
which fails, instead of overwriting the new holder's lease. A run whose lease
was taken over stops: each step and each commit checks the lease is still its
own (`check`, one read) and raises `LeaseLost`, so the run fails in one line
before it writes anything more under the run root. Other stores compare and
then write, which is not atomic: two takeovers at the same moment can both
succeed there, and the loser learns it at its next step.

`txflow prune` may run on another machine than the run, against the same
bucket, so a local `cluster.json` cannot tell it a run is still going. The
lease can: it names its holder and an expiry, renewed every `RENEW_S` while
the flow runs (an approval's wait included), and deleted when the run ends.
A run whose orchestrator died stops renewing it; after `TTL_S` the run counts
as unfinished, which prune leaves alone unless told `--include-failed`.
"""

from __future__ import annotations

import errno
import fcntl
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


class LeaseLost(RuntimeError):
    """This run's lease was taken over: another run holds the run id now, so this one must stop."""


def _record(run_id: str, token: str, ttl_s: float) -> bytes:
    now = time.time()
    return json.dumps({"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
                       "started": start_time(os.getpid()), "token": token, "renewed_at": now,
                       "expires_at": now + ttl_s}).encode()


def _is_local(fs) -> bool:
    return "file" in fs.protocol or "local" in fs.protocol


def _is_s3(fs) -> bool:
    return hasattr(fs, "call_s3")  # s3fs: conditional requests by ETag


# What a run last saw of a lease, to change it only if it is still that: its ETag on S3, else its bytes.
Version = str | bytes


def _create(fs, path: str, data: bytes) -> Version | None:
    """Write `data` at `path` only when nothing is there: its version, or None when something is."""
    try:
        if _is_local(fs):
            temporary = f"{path}.{secrets.token_hex(4)}.tmp"
            with open(temporary, "wb") as f:
                f.write(data)
            try:
                os.link(temporary, path)  # fails when the name exists; the file is whole before it appears
            finally:
                os.unlink(temporary)
        elif _is_s3(fs):
            return fs.pipe_file(path, data, mode="create")["ETag"]
        else:
            fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        return None
    return data


@contextmanager
def _locked(path: str):
    """Exclusive, among the processes of this machine, over the directory holding the local lease `path`."""
    directory = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        fcntl.flock(directory, fcntl.LOCK_EX)
        yield
    finally:
        os.close(directory)  # and with it the lock


def _conflict(exc: OSError) -> bool:
    """Whether an S3 write failed because another write to the object came first: 412 PreconditionFailed
    (s3fs's EINVAL), or 409 ConditionalRequestConflict, which S3 answers to one of two concurrent ones."""
    code = getattr(exc.__cause__, "response", {}).get("Error", {}).get("Code")
    return exc.errno == errno.EINVAL or code == "ConditionalRequestConflict"


def _swap(fs, path: str, seen: Version, data: bytes) -> Version | None:
    """Replace the lease at `path` with `data` only if it is still `seen`: the new version, or None when it
    changed or went in between."""
    if _is_s3(fs):
        try:
            return fs.pipe_file(path, data, IfMatch=seen)["ETag"]
        except FileNotFoundError:
            return None
        except OSError as exc:
            if _conflict(exc):
                return None
            raise
    if _is_local(fs):
        with _locked(path):
            try:
                with open(path, "rb") as f:
                    if f.read() != seen:
                        return None
            except FileNotFoundError:
                return None
            temporary = f"{path}.{secrets.token_hex(4)}.tmp"
            with open(temporary, "wb") as f:
                f.write(data)
            os.replace(temporary, path)  # readers see the old lease or the new, never part of one
        return data
    try:
        if fs.cat_file(path) != seen:
            return None
    except FileNotFoundError:
        return None
    fs.pipe_file(path, data)  # not atomic with the comparison (module docstring)
    return data


def _remove(fs, path: str, seen: Version) -> None:
    """Delete the lease at `path` only if it is still `seen`: never another run's."""
    if _is_s3(fs):
        bucket, key, _ = fs.split_path(path)
        try:
            fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=seen)
        except OSError as exc:
            if not _conflict(exc):  # else it is another run's now
                raise
        fs.invalidate_cache(path)
        return
    if _is_local(fs):
        with _locked(path):
            with open(path, "rb") as f:
                if f.read() == seen:
                    os.unlink(path)
        return
    if fs.cat_file(path) == seen:
        fs.rm_file(path)


def _changed_while_read(exc: OSError) -> bool:
    """Whether s3fs failed a read because the object changed between its HEAD and its GET (If-Match failed):
    EINVAL from the request, or s3fs's FileExpired (EBUSY) that it raises from it."""
    return exc.errno in (errno.EINVAL, errno.EBUSY)


def _read(fs, path: str) -> tuple[dict | None, Version | None]:
    """The lease at `path` and its version, (None, None) when there is none; ({}, version) when it is
    unreadable (no holder can be named)."""
    for attempt in range(3):
        try:
            if _is_s3(fs):
                fs.invalidate_cache(path)
                with fs.open(path, "rb") as f:  # s3fs reads with If-Match the ETag it found: body and ETag agree
                    raw, seen = f.read(), f.details["ETag"]
            else:
                raw = seen = fs.cat_file(path)
            break
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            if not _changed_while_read(exc) or attempt == 2:
                raise
    try:
        record = json.loads(raw)
    except ValueError:
        return {}, seen
    return (record if isinstance(record, dict) else {}), seen


def stale(record: dict) -> str | None:
    """Why the holder of lease `record` looks dead, or None while it looks alive. On this host its process
    says so; for another host's holder this reads that host's timestamp against this one's clock, so it is
    only a hint: `txflow prune` uses it to leave a run alone, a takeover watches the lease (`_acquire`)."""
    expires_at = record.get("expires_at")
    if not isinstance(expires_at, (int, float)):
        return "the lease is unreadable"
    pid = record.get("host") == socket.gethostname() and record.get("pid")
    if isinstance(pid, int) and pid:
        return None if is_alive(pid, record.get("started")) else f"its process {pid} on this host is gone"
    if expires_at < time.time():
        return f"not renewed for {time.time() - float(record.get('renewed_at') or expires_at):.0f} s"
    return None


def _on_this_host(record: dict) -> bool:
    return record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int)


def _unchanged_for(fs, path: str, seen: Version, ttl_s: float, poll_s: float) -> Version | None:
    """Watch the lease at `path`, last seen as `seen`, on this process's monotonic clock: `seen` again when it
    stayed the same for `ttl_s`, None as soon as it changed or went (its holder renewed or released it)."""
    began = time.monotonic()
    while time.monotonic() - began < ttl_s:
        time.sleep(min(poll_s, max(0.0, ttl_s - (time.monotonic() - began))))
        try:
            _, now = _read(fs, path)
        except OSError as exc:
            if not _changed_while_read(exc):
                raise
            return None  # it changed under each of _read's looks: other runs are writing it, so it changed
        if now != seen:
            return None
    return seen


def describe(record: dict, run_root: str) -> str:
    """One line naming the live run that holds `record`."""
    age = time.time() - float(record.get("renewed_at") or time.time())
    return (f"Run {record.get('run_id')} is running under {run_root} (host {record.get('host')}, pid "
            f"{record.get('pid')}, lease renewed {age:.0f} s ago): one live run per run id. Wait for it to end, "
            f"or use another --run-id")


def holder(run_root: str, storage_options: dict | None = None) -> dict | None:
    """The lease of the live run under `run_root`, or None when no live run holds it."""
    fs, root = fsspec.core.url_to_fs(run_root, **(storage_options or {}))
    record, _ = _read(fs, f"{root.rstrip('/')}/{LEASE}")
    return record if record is not None and stale(record) is None else None


def alive(run_root: str, storage_options: dict | None = None) -> bool:
    """Whether a live run holds `run_root`'s lease now."""
    return holder(run_root, storage_options) is not None


def _acquire(fs, path: str, run_root: str, run_id: str, token: str, ttl_s: float, poll_s: float) -> Version:
    """Create the lease; take it over from a dead holder; raise LeaseHeld when a live one has it. The lease's
    version."""
    for _ in range(3):  # a lease that vanishes or is taken over between two looks: look again
        data = _record(run_id, token, ttl_s)
        version = _create(fs, path, data)
        if version is not None:
            return version
        record, seen = _read(fs, path)
        if record is None:
            continue
        why = stale(record)
        if why is None:
            raise LeaseHeld(describe(record, run_root))
        if record and not _on_this_host(record):
            # Another host's clock said it is old: watched here, on this clock, before it is believed.
            get_logger().warning(f"the lease of run {record.get('run_id')} under {run_root} (host "
                                 f"{record.get('host')}) looks {why}; watching it for {ttl_s:.0f} s before taking "
                                 f"it over (a live holder renews it every {RENEW_S:.0f} s)")
            if _unchanged_for(fs, path, seen, ttl_s, poll_s) is None:
                record, _ = _read(fs, path)
                if record is None:
                    continue
                raise LeaseHeld(describe(record, run_root) + " (it was renewed while this run watched it)")
            why = f"unchanged for {ttl_s:.0f} s as this host watched it"
            data = _record(run_id, token, ttl_s)
        version = _swap(fs, path, seen, data)
        if version is not None:
            get_logger().warning(f"took over the lease of run {record.get('run_id')} under {run_root} (host "
                                 f"{record.get('host')}, pid {record.get('pid')}): its holder is dead ({why})")
            return version
    raise LeaseHeld(f"Another run keeps taking the lease of {run_root} (run id {run_id}); use another --run-id")


class _Holding:
    """A lease this process holds: its last version, and why it was lost, once it was."""

    def __init__(self, fs, path: str, run_root: str, run_id: str, version: Version):
        self.fs, self.path, self.run_root, self.run_id, self.version = fs, path, run_root, run_id, version
        self.lost: str | None = None
        self.lock = threading.Lock()  # a renewal and a check never interleave

    def mark_lost(self) -> str:
        record, _ = _read(self.fs, self.path)
        self.version, self.lost = None, (
            f"run {self.run_id}: its lease of {self.run_root} was taken over (by run "
            f"{(record or {}).get('run_id')} on host {(record or {}).get('host')}); this run stops here, "
            f"before it writes more under a run root that is another run's now")
        get_logger().error(self.lost)
        return self.lost


# The leases this process holds, by URL: `txflow run` takes its run's before the flow starts (so a second run
# is refused before anything starts), and the flow's own `held(..., join=True)` joins it.
_held_here: dict[str, _Holding] = {}


def check(run_root: str, storage_options: dict | None = None) -> None:
    """Raise LeaseLost when this process held `run_root`'s lease and it is no longer its own (one read); a
    run root this process holds no lease of passes."""
    fs, root = fsspec.core.url_to_fs(run_root, **(storage_options or {}))
    holding = _held_here.get(fs.unstrip_protocol(f"{root.rstrip('/')}/{LEASE}"))
    if holding is None:
        return
    with holding.lock:
        if holding.lost is None:
            _, now = _read(holding.fs, holding.path)
            if now != holding.version:
                holding.mark_lost()
        if holding.lost is not None:
            raise LeaseLost(holding.lost)


@contextmanager
def held(run_root: str, run_id: str, storage_options: dict | None = None, ttl_s: float = TTL_S,
         renew_s: float = RENEW_S, join: bool = False):
    """Hold the run's lease for the duration of the block. Raises LeaseHeld, before the block, when a live
    run holds it. With `join`, a lease this process holds already is held with it (not refused)."""
    fs, root = fsspec.core.url_to_fs(run_root, **(storage_options or {}))
    fs.makedirs(root, exist_ok=True)
    path = f"{root.rstrip('/')}/{LEASE}"
    url = fs.unstrip_protocol(path)
    if join and url in _held_here:
        yield path
        return
    token = secrets.token_hex(16)
    holding = _Holding(fs, path, run_root, run_id, _acquire(fs, path, run_root, run_id, token, ttl_s,
                                                           poll_s=min(renew_s, ttl_s / 10)))
    _held_here[url] = holding
    stop = threading.Event()

    def renew():
        while not stop.wait(renew_s):
            with holding.lock:
                if holding.lost is not None:
                    return
                try:
                    renewed = _swap(fs, path, holding.version, _record(run_id, token, ttl_s))
                except Exception:  # a store briefly away: the next renewal tries again, well within the TTL
                    continue
                if renewed is None:
                    holding.mark_lost()
                    return
                holding.version = renewed

    thread = threading.Thread(target=renew, name="txflow-lease", daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join()
        _held_here.pop(url, None)
        try:
            if holding.version is not None:
                _remove(fs, path, holding.version)  # never another run's lease
        except Exception:  # gone already, or the store away: the lease then expires on its own
            pass
