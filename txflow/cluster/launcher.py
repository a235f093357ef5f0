"""The interface of the launchers that place a cluster's processes (`launchers/`), and what they raise."""

from __future__ import annotations

from abc import ABC, abstractmethod

from txflow.cluster.records import Cluster, ProcessRecord, Role


class PlacementFailed(RuntimeError):
    """The launcher cannot place the cluster; the message says what was asked and what there is.
    Retrying at once does not help, so nothing retries it."""


class Launcher(ABC):
    """Places the processes of a cluster, reports their exit, shows their logs and stops them."""

    name: str

    @abstractmethod
    def place(self, cluster: Cluster, host: str) -> None:
        """Decide where the API and rank 0 run: fill in `cluster.host`, `api_port` and
        `coordinator_port` (picked where they will be bound) and save cluster.json. The API's port is
        bound here, where the API runs, and stays bound until `start` hands the socket to the API
        (`txflow.processes.ports.LISTEN_FD_ENV`): no other process can take it in between."""

    @abstractmethod
    def start(self, cluster: Cluster, role: Role, rank: int | None, cmd: list[str], env: dict[str, str],
              ports: dict[str, int], log_name: str, secret_env: dict[str, str] | None = None) -> ProcessRecord:
        """Start one process (with `env` and `secret_env` on top of its node's environment, the run's
        credential variables taken out of it) and record it in cluster.json before returning. `secret_env`
        reaches the process by environment only: never a command line, a log, or a record a launcher
        keeps (Ray's call arguments); only rank 0's node gets any. The API (`role` "api") inherits the
        socket `place` bound."""

    @abstractmethod
    def exit_code(self, record: ProcessRecord) -> int | None:
        """None while the process runs, else its exit code (negative: killed by that signal)."""

    @abstractmethod
    def tail(self, record: ProcessRecord, lines: int = 30) -> str:
        """The last lines of the process's log."""

    @abstractmethod
    def stop(self, cluster: Cluster, grace_s: float = 5.0) -> list[ProcessRecord]:
        """Stop every process of the cluster and release what `place` reserved; returns the
        records with exit codes. Works from cluster.json alone (a hook in another process)."""


class LostProcess(RuntimeError):
    """A launcher cannot reach a process any more (its node or its actor is gone); it counts as dead."""
