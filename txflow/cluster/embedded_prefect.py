"""The embedded Prefect server of `txflow run`, started by txflow instead of Prefect.

Prefect starts its ephemeral API server (`SubprocessASGIServer`: uvicorn on
`prefect.server.api.server:create_app`, loopback, UI off) on first use, in a
process that outlives a `txflow` killed by SIGKILL. txflow starts the same
server itself, under the lifeline guard, so it dies with `txflow`; and it
starts it early, so the server's ~7-12 s start-up overlaps the flow's imports.
With `PREFECT_API_URL` set, that server is used and nothing is started.

Two `txflow run`s at once share one Prefect database (`PREFECT_HOME`). A Prefect
server registers its block types at start-up by "select, then insert if
missing", so two servers starting together on one database race, and the loser
exits with `UNIQUE constraint failed: block_type.slug` (seen in CI). Start-ups
therefore take turns under a file lock in `PREFECT_HOME`, held until the server
answers; once started, servers share the database fine (SQLite WAL).
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from txflow.config import environ_without_secrets
from txflow.processes import groups, lifeline, logs, ports

STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
# Prefect's default of 20 s is less than a first start (a new database, every migration) took on
# a busy 2-core machine.
DEFAULT_STARTUP_TIMEOUT_S = 120.0


# Automations (reactive and proactive triggers, their actions) off in the embedded server: it lives for one
# run, so an automation could only ever see that run, and the trigger services cost ~1 s of CPU per run
# (at start, then ~1.5% of a core) that the ranks need on 2 cores. A real `prefect server` (PREFECT_API_URL)
# is untouched; setting the variable turns them back on here.
EMBEDDED_DEFAULTS = {"PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false"}


def startup_timeout_s() -> float:
    """How long the server may take to answer: Prefect's own setting when given, else 120 s."""
    return float(os.environ.get(STARTUP_TIMEOUT_ENV) or DEFAULT_STARTUP_TIMEOUT_S)


def prefect_home() -> Path:
    """Prefect's home directory (its SQLite database lives there by default), without importing Prefect."""
    return Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()


class StartLock:
    """An exclusive flock on `<PREFECT_HOME>/txflow-server-start.lock`: one server start at a time per
    database. The kernel drops it when its holder dies, however it dies."""

    def __init__(self, home: Path, timeout_s: float):
        home.mkdir(parents=True, exist_ok=True)
        self.path = home / "txflow-server-start.lock"
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.release()
                    raise RuntimeError(f"Another Prefect server start held {self.path} for more than "
                                       f"{timeout_s:.0f} s ({STARTUP_TIMEOUT_ENV} sets the limit).") from None
                time.sleep(0.05)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None


class EmbeddedServer:
    def __init__(self, log: Path):
        self.log = log
        self._start_lock = StartLock(prefect_home(), startup_timeout_s())
        # Bound here and inherited by the server (uvicorn --fd): no other local user can take the port between
        # its pick and the server's start and receive the run's Prefect traffic.
        listening = ports.listener("127.0.0.1")
        self.port = listening.getsockname()[1]
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        # What Prefect's SubprocessASGIServer sets for its server process, and EMBEDDED_DEFAULTS under
        # whatever the environment sets.
        env = {**EMBEDDED_DEFAULTS, **environ_without_secrets(), "PREFECT_UI_ENABLED": "0",
               "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
               ports.LISTEN_FD_ENV: str(listening.fileno())}
        cmd = [sys.executable, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
               "--fd", str(listening.fileno()), "--log-level", "error", "--lifespan", "on"]
        try:
            self.proc = groups.spawn(lifeline.guarded(cmd), log, env=lifeline.child_env(env),
                                     pass_fds=(listening.fileno(),))
        except BaseException:  # no server, so no `stop`: the next start in this process must not wait on us
            self._start_lock.release()
            raise
        finally:
            listening.close()  # the server's now

    def wait_ready(self) -> None:
        """Block until the server answers /health; fail with its log when it dies or does not answer in time.
        Either way the start-up lock is released."""
        try:
            self._wait_ready()
        finally:
            self._start_lock.release()

    def _wait_ready(self) -> None:
        import httpx

        timeout_s = startup_timeout_s()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"The embedded Prefect server exited with code {self.proc.returncode}. "
                                   f"Last lines of {self.log}:\n{logs.tail(self.log)}")
            try:
                if httpx.get(f"{self.api_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"The embedded Prefect server did not answer within {timeout_s:.0f} s "
                                   f"({STARTUP_TIMEOUT_ENV} sets the limit). Last lines of {self.log}:\n"
                                   f"{logs.tail(self.log)}")
            time.sleep(0.1)

    def stop(self) -> None:
        self._start_lock.release()
        groups.stop_groups([self.proc.pid], grace_s=5.0)
        self.proc.wait(timeout=10)


@contextmanager
def server(state_dir: str):
    """Start the embedded server (unless PREFECT_API_URL names one) and point this process's Prefect
    client at it; yields it (or None) and stops it at the end. Either way, Prefect's log and event
    workers have delivered what they hold when this returns (`txflow` then exits without running
    Prefect's exit handlers: `cli.entry`)."""
    if os.environ.get("PREFECT_API_URL"):
        try:
            yield None
        finally:
            _drain_prefect_workers()
        return
    global _embedded_url
    embedded = EmbeddedServer(Path(state_dir) / "logs" / "prefect-server.log")
    os.environ["PREFECT_API_URL"] = _embedded_url = embedded.api_url
    try:
        with _prefect_settings(embedded.api_url):
            yield embedded
    finally:
        _drain_prefect_workers()
        embedded.stop()
        os.environ.pop("PREFECT_API_URL", None)
        _embedded_url = None


_embedded_url: str | None = None


def is_embedded() -> bool:
    """Whether this process's Prefect API is the embedded server of `txflow run` (it lives for one run)."""
    return _embedded_url is not None and os.environ.get("PREFECT_API_URL") == _embedded_url


@contextmanager
def _prefect_settings(api_url: str):
    """Prefect reads its settings from the environment once, when it is imported. A process that imported
    it before the server existed would ignore PREFECT_API_URL and start a server of its own (not under
    the lifeline, with a 20 s start-up limit); point its settings at ours as well."""
    if "prefect" not in sys.modules:
        yield  # imported later, it reads the environment
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        yield


def _drain_prefect_workers() -> None:
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=10)
