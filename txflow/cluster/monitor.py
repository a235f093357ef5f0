"""The one place that decides whether a cluster is healthy.

JAX only notices a missing rank through its coordination-service heartbeat
(~90 s) and then aborts without saying which rank died. The monitor asks the
launcher about every process every `interval_s`, records each dead process
ONCE with its exit code, the time it was detected and the tail of its log,
and wakes everyone waiting on the cluster (`on_failure`), so that a request in
flight is abandoned at once. Nothing else asks the launcher whether a process
lives: waits ask the monitor (`raise_if_failed`, `ClusterHandle.wait`).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from txflow.checkpoints.lease import LeaseLost
from txflow.cluster.launcher import Launcher, LostProcess
from txflow.cluster.records import Cluster, ProcessRecord, describe_exit
from txflow.log import get_logger


@dataclass
class Failure:
    """One cluster fault of the run: a dead process, or a request without progress."""

    rank: int | None
    role: str
    exit_code: int | None
    detected_at: float
    message: str
    abandoned_at: float | None = None  # when the request in flight was given up because of it
    step: str | None = None  # the pipeline step it interrupted
    resumed_at: str | None = None  # the step the retry started from
    resumed_from_step: int | None = None  # the training step it resumed from

    def as_dict(self) -> dict:
        return asdict(self)


class ClusterFault(RuntimeError):
    """The cluster cannot go on; only a fresh one can (task retries on this one are useless)."""


class RankDied(ClusterFault):
    """A process of the cluster exited."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.failure = failure


class NoProgress(ClusterFault, TimeoutError):
    """A request made no progress within its deadline."""


def retry_unless(*kinds: type[BaseException]) -> Callable:
    """A Prefect `retry_condition_fn` that retries a failed task unless its exception is one of `kinds`."""

    def condition(task, task_run, state) -> bool:
        exc = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
        return not isinstance(exc, kinds)

    return condition


# A task retry runs on the same cluster, which is useless after a dead rank or a request without
# progress (and would cost another `step_timeout_s`); the flow retries those on a fresh cluster instead.
# Nor is a run whose lease was taken over retried: another run holds its run root now.
retry_unless_cluster_fault = retry_unless(ClusterFault, LeaseLost)


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
        self._listeners: list[Callable[[Failure], None]] = []
        # The flow polls too when a request fails; without the lock it could find a death that
        # the thread has marked seen but not yet recorded, and take a cluster fault for a plain error.
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"rank-monitor-{self.cluster.run_id}", daemon=True)

    def start(self) -> RankMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def poll(self) -> Failure | None:
        """Check every process once; returns the first new failure (also recorded and logged once).

        Safe to call from any thread: when it returns, every death it or a concurrent call
        found is in `failures`.
        """
        first = None
        with self._lock:
            for record, code, cause in self._exited():  # the cause first
                self._seen.add(id(record))
                record.exit_code = code
                failure = Failure(rank=record.rank, role=record.role, exit_code=code, detected_at=time.time(),
                                  message=describe_exit(record, code, self.launcher.tail(record), cause))
                self.failures.append(failure)
                get_logger().error(f"dead process detected: {failure.message}")
                self.failed.set()
                first = first or failure
                for listener in list(self._listeners):
                    listener(failure)
        return first

    def first_failure(self) -> Failure | None:
        """The failure that broke the cluster: a dead rank before the API that exited because of it."""
        return next((f for f in self.failures if f.role != "api"), None) or next(iter(self.failures), None)

    def settle(self, timeout_s: float = 3.0) -> Failure | None:
        """After an error that a peer's death may explain: the failure that broke the cluster, looking now
        and, when nothing is found yet, waiting up to `timeout_s` for the monitor to find one (a dead local
        process shows at once; a lost Ray node only when Ray gives up on its actor, ~2.5 s)."""
        self.poll()
        if self.first_failure() is None:
            self.failed.wait(timeout_s)
        return self.first_failure()

    def raise_if_failed(self) -> None:
        """Raise RankDied naming the process whose exit broke the cluster, if one has exited."""
        failure = self.first_failure()
        if failure is not None:
            raise RankDied(failure)

    def on_failure(self, listener: Callable[[Failure], None]) -> Callable[[], None]:
        """Call `listener(failure)` at each death (at once if one was already recorded); returns
        a function that unsubscribes it."""
        with self._lock:
            self._listeners.append(listener)
            known = self.first_failure()
        if known is not None:
            listener(known)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _exited(self) -> list[tuple[ProcessRecord, int | None, str | None]]:
        """(record, exit code, cause) of each process found dead since the last poll.

        A JAX rank whose peer vanished mid-collective aborts (SIGABRT) within a
        second, so when several are found at once the other deaths come first:
        they are the cause.
        """
        found = []
        for record in list(self.cluster.processes):
            if id(record) in self._seen:
                continue
            code, cause = self._status(record)
            if code is not None or cause is not None:
                found.append((record, code, cause))
        return sorted(found, key=lambda item: item[1] == -signal.SIGABRT)

    def _status(self, record: ProcessRecord) -> tuple[int | None, str | None]:
        """(exit code, None) of an exited process; (None, why) when the launcher lost it
        (a node gone); (None, None) while it runs."""
        try:
            return self.launcher.exit_code(record), None
        except LostProcess as lost:
            return None, str(lost)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()
