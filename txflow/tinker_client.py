"""Tinker SDK clients pointed at the run's own cluster."""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import tinker

from txflow.cluster import Cluster, Launcher, describe_exit, exited


# ServiceClients opened per cluster (by state directory). Each one heartbeats its session from a
# background thread until closed; nothing closes it when the cluster goes away, so a long-lived
# process (a Prefect worker, the test suite) would heartbeat dead clusters forever.
_open_clients: dict[str, list[tinker.ServiceClient]] = {}


def _key(state_dir) -> str:
    return str(Path(state_dir).absolute())


def service_client(cluster: Cluster) -> tinker.ServiceClient:
    """A ServiceClient for the cluster's API (never the hosted default); teardown closes it."""
    client = tinker.ServiceClient(base_url=cluster.base_url, api_key=cluster.api_key.get_secret_value())
    _open_clients.setdefault(_key(cluster.state_dir), []).append(client)
    return client


def close_clients(state_dir) -> int:
    """Stop the session heartbeats of every client opened for the cluster in `state_dir`."""
    clients = _open_clients.pop(_key(state_dir), [])
    for client in clients:
        client.holder.close()
    return len(clients)


class RankDied(RuntimeError):
    """A process of the cluster exited while a request was in flight."""

    def __init__(self, message: str, rank: int | None, exit_code: int):
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code


def check_ranks(cluster: Cluster, launcher: Launcher) -> None:
    """Raise RankDied naming the process whose exit broke the cluster, if one has exited."""
    found = exited(cluster, launcher)
    if found:
        record, code = found[0]
        raise RankDied(describe_exit(record, code), record.rank, code)


def wait_result(future, cluster: Cluster, launcher: Launcher, timeout_s: float, what: str):
    """`future.result()`, but fail fast when a rank dies and give up after `timeout_s`.

    A Tinker future would otherwise wait for JAX's heartbeat abort (~90 s) or
    forever; here a dead rank is named within a poll interval.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return future.result(timeout=0.25)
        except (TimeoutError, FutureTimeout):
            pass
        check_ranks(cluster, launcher)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} made no progress for {timeout_s:.0f} s")
