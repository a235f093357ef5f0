"""A running run says so in its root: `<run_root>/lease.json`, renewed while the run lives.

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
import socket
import threading
import time
from contextlib import contextmanager

import fsspec

LEASE = "lease.json"
TTL_S = 600.0
RENEW_S = 60.0


def _write(fs, path: str, run_id: str, ttl_s: float) -> None:
    fs.pipe_file(path, json.dumps({"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid(),
                                   "expires_at": time.time() + ttl_s}).encode())


@contextmanager
def held(run_root: str, run_id: str, storage_options: dict | None = None, ttl_s: float = TTL_S,
         renew_s: float = RENEW_S):
    """Hold the run's lease for the duration of the block."""
    fs, root = fsspec.core.url_to_fs(run_root, **(storage_options or {}))
    fs.makedirs(root, exist_ok=True)
    path = f"{root.rstrip('/')}/{LEASE}"
    _write(fs, path, run_id, ttl_s)
    stop = threading.Event()

    def renew():
        while not stop.wait(renew_s):
            try:
                _write(fs, path, run_id, ttl_s)
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
            fs.rm_file(path)
        except Exception:  # gone already, or the store away: the lease then expires on its own
            pass


def alive(run_root: str, storage_options: dict | None = None) -> bool:
    """Whether a run holds `run_root`'s lease now."""
    fs, root = fsspec.core.url_to_fs(run_root, **(storage_options or {}))
    try:
        record = json.loads(fs.cat_file(f"{root.rstrip('/')}/{LEASE}"))
    except FileNotFoundError:
        return False
    except ValueError:  # a lease being written: count it as held
        return True
    return float(record.get("expires_at", 0)) > time.time()
