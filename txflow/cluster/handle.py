"""One handle on a running cluster: its record, the launcher that placed it, the
monitor that watches it, and the Tinker clients opened against it. Steps take
this one object instead of a cluster and a launcher."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from txflow.cluster.compiles import CompileWatch
from txflow.cluster.launcher import Launcher
from txflow.cluster.monitor import ClusterFault, NoProgress, RankDied, RankMonitor
from txflow.cluster.records import Cluster, ProcessRecord

WAIT_THREADS = 4
OPEN_TIMEOUT_S = 120.0  # a session opens in well under a second on a live API


def _concurrent_future(future) -> Future | None:
    """The `concurrent.futures.Future` a Tinker future resolves through, or None. Sampling returns one; the
    SDK's APIFuture and AwaitableConcurrentFuture keep one as `_future` (tinker 0.13.1, the SDK txflow's own
    clients use); a combined future of chunked requests has none."""
    if isinstance(future, Future):
        return future
    inner = getattr(future, "_future", None)
    return inner if isinstance(inner, Future) else None


@dataclass(eq=False)
class ClusterHandle:
    cluster: Cluster
    launcher: Launcher
    monitor: RankMonitor
    # ServiceClients opened against this cluster. Each heartbeats its session from a background
    # thread until closed; nothing else closes it, so a long-lived process (a Prefect worker, the
    # test suite) would heartbeat a dead cluster forever.
    clients: list = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)  # of every client ever opened: what a release frees
    waiters: ThreadPoolExecutor | None = None  # for futures without a done callback (see `wait`)
    # The name of the shared cluster this run attached to (`txflow.cluster.named`), and what its teardown
    # does instead of stopping processes: release the run's part of it, leaving the cluster up.
    shared: str | None = None
    release: Callable[[ClusterHandle], list[ProcessRecord]] | None = None
    compiles: CompileWatch | None = None  # what rank 0 compiles, said as it happens (a cluster of the run's own)

    @classmethod
    def watch(cls, cluster: Cluster, launcher: Launcher) -> ClusterHandle:
        """A handle whose monitor watches every process the cluster has or will get."""
        return cls(cluster=cluster, launcher=launcher, monitor=RankMonitor(cluster, launcher).start(),
                   compiles=CompileWatch(cluster).start())

    def service_client(self, timeout_s: float = OPEN_TIMEOUT_S):
        """A Tinker ServiceClient for this cluster's API (never the hosted default); `close` closes it. Opening
        its session is abandoned at a death like any wait on the cluster: against an API that is gone (a
        shared cluster killed) the SDK retries for about a minute before it gives up."""
        from txflow.upstream.tinker_sdk import tinker

        client = self.call(lambda: tinker.ServiceClient(base_url=self.cluster.base_url,
                                                        api_key=self.cluster.api_key.get_secret_value()),
                           "opening a Tinker session", timeout_s)
        self.clients.append(client)
        self.sessions.append(client.holder.get_session_id())
        return client

    def base_sampler(self, client=None, timeout_s: float = OPEN_TIMEOUT_S):
        """A sampling client of the cluster's base model, on `client` (or a new ServiceClient); opening it is
        abandoned at a death like any wait on the cluster. The one way every step opens it."""
        client = client or self.service_client(timeout_s)
        return self.call(lambda: client.create_sampling_client(base_model=self.cluster.base_model_path),
                         "opening a base-model sampler", timeout_s)

    def wait(self, future, what: str, timeout_s: float):
        """`future.result()`, abandoned as soon as the monitor records a dead process, or after
        `timeout_s` without a result.

        A Tinker future would otherwise wait for JAX's heartbeat abort (~90 s) or forever. Whichever
        comes first, result or death, wakes this thread: no polling interval is added to a request. The
        result arrives through a callback on the future (no thread per request, so waits abandoned
        after a death leave nothing blocked behind them); a future that offers none is awaited in a small
        pool of threads shared by the handle.
        """
        box: queue.SimpleQueue = queue.SimpleQueue()

        def deliver(done) -> None:
            try:
                box.put(("result", done.result()))
            except BaseException as exc:  # handed to the waiting thread, which raises it
                box.put(("error", exc))

        inner = _concurrent_future(future)
        if inner is not None:
            inner.add_done_callback(deliver)
        else:
            self._waiters().submit(lambda: future.result()).add_done_callback(deliver)
        unsubscribe = self.monitor.on_failure(lambda failure: box.put(("died", failure)))
        try:
            kind, value = box.get(timeout=timeout_s)
        except queue.Empty:
            raise NoProgress(f"{what} made no progress for {timeout_s:.0f} s") from None
        finally:
            unsubscribe()
        if kind == "result":
            return value
        if kind == "error":
            # A rank's death often reaches the client first, as a failed request: let the monitor look,
            # so the error names the dead rank instead of the peer error it caused.
            value = self.monitor.settle() or value
        if isinstance(value, BaseException):
            raise value
        if value.abandoned_at is None:
            value.abandoned_at = time.time()
        raise RankDied(value)

    def call(self, fn, what: str, timeout_s: float):
        """`fn()`, an SDK call that waits on the engine inside itself (creating a training client, saving
        weights for a sampler), abandoned like `wait`. When the engine itself dies, the API still answers
        "pending" and such a call would wait forever. It runs in a daemon thread of its own, which the
        cluster's teardown ends (its requests fail once the API is gone) and which never holds up an exit.
        """
        done: Future = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:  # raised in the waiting thread by `wait`
                done.set_exception(exc)

        threading.Thread(target=run, name="txflow-call", daemon=True).start()
        return self.wait(done, what, timeout_s)

    def _waiters(self) -> ThreadPoolExecutor:
        if self.waiters is None:
            self.waiters = ThreadPoolExecutor(max_workers=WAIT_THREADS, thread_name_prefix="txflow-wait")
        return self.waiters

    @contextmanager
    def deaths_first(self):
        """Inside: an error raised while a process of the cluster is dead becomes that death (RankDied).

        SDK calls that block on their own (creating a client, reading a training run) surface a dead
        rank as a peer error; without this a task retry would run again on the dead cluster.
        """
        try:
            yield
        except ClusterFault:
            raise
        except Exception as exc:
            failure = self.monitor.settle()
            if failure is None:
                raise
            if failure.abandoned_at is None:
                failure.abandoned_at = time.time()
            raise RankDied(failure) from exc

    def close_clients(self) -> int:
        """Stop the session heartbeats of every client opened for this cluster."""
        clients, self.clients = self.clients, []
        for client in clients:
            client.holder.close()
        return len(clients)

    def stop(self, grace_s: float = 5.0) -> list[ProcessRecord]:
        """Teardown: clients first (their heartbeats would only fail once the API is gone), then
        the monitor (a stopped process is no failure), then every process. A run attached to a shared
        cluster releases its part of it instead (`txflow.cluster.named.release`)."""
        if self.compiles is not None:
            self.compiles.stop()
        if self.release is not None:
            return self.release(self)
        self.close_clients()
        self.monitor.stop()
        if self.waiters is not None:
            self.waiters.shutdown(wait=False, cancel_futures=True)
        return self.launcher.stop(self.cluster, grace_s)
