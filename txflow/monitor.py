"""Watch every process of a running cluster and report the first one that dies.

JAX only notices a missing rank through its coordination-service heartbeat
(~90 s) and then aborts without saying which rank died. The monitor polls the
launcher every `interval_s`, records each dead process ONCE with its exit code,
the time it was detected and the tail of its log, and sets `failed` so that
waits on Tinker futures stop at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from txflow.cluster import Cluster, Launcher, describe_exit, exited
from txflow.log import get_logger


@dataclass
class Failure:
    """One detected failure of the run (a dead process or a request without progress)."""

    rank: int | None
    role: str
    exit_code: int | None
    detected_at: float
    message: str
    resumed_from_step: int | None = None

    def as_dict(self) -> dict:
        return {"rank": self.rank, "role": self.role, "exit_code": self.exit_code, "detected_at": self.detected_at,
                "resumed_from_step": self.resumed_from_step, "message": self.message}


@dataclass
class RankMonitor:
    cluster: Cluster
    launcher: Launcher
    interval_s: float = 0.5
    failures: list[Failure] = field(default_factory=list)
    failed: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._seen: set[int] = set()
        # The flow polls too when a request fails; without the lock it could find a death that
        # the thread has marked seen but not yet recorded, and take a cluster fault for a plain error.
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"rank-monitor-{self.cluster.run_id}", daemon=True)

    def start(self) -> RankMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def poll(self) -> Failure | None:
        """Check every process once; returns the first new failure (also recorded and logged once).

        Safe to call from any thread: when it returns, every death it or a concurrent call
        found is in `failures`.
        """
        first = None
        with self._lock:
            for record, code in exited(self.cluster, self.launcher, skip=self._seen):  # the cause first
                self._seen.add(record.pid)
                failure = Failure(rank=record.rank, role=record.role, exit_code=code, detected_at=time.time(),
                                  message=describe_exit(record, code))
                self.failures.append(failure)
                get_logger().error(f"dead process detected: {failure.message}")
                self.failed.set()
                first = first or failure
        return first

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()
