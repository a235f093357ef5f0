"""The run's cluster: what processes exist, and how to start and stop them.

`cluster.json` in the run's local state directory is the record of truth:
it is written as soon as a process exists, and teardown works from it alone,
so a cancellation hook or another process can stop a run's cluster too.

A `Launcher` places processes. `LocalLauncher` starts subprocesses on this
machine; a launcher for Ray places each rank as an actor on its own node and
implements the same four methods, so the pipeline tasks do not change.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr

from txflow import processes

Role = Literal["coordinator", "worker", "api"]


class ProcessRecord(BaseModel):
    """One process of the cluster, as written to cluster.json."""

    role: Role
    rank: int | None = Field(description="JAX process index; None for the API server")
    pid: int
    pgid: int
    start_time: int | None = Field(default=None, description="Kernel start time, to tell pid reuse apart")
    host: str
    ports: dict[str, int] = Field(default_factory=dict)
    log: str
    exit_code: int | None = None


class Cluster(BaseModel):
    """The cluster of one run, persisted as `<state_dir>/cluster.json`."""

    run_id: str
    launcher: str
    state_dir: str
    host: str
    api_port: int
    coordinator_port: int | None
    num_processes: int
    base_model_path: str = Field(description="What the engine loaded for --base-model")
    checkpoints_base: str = Field(description="Where the engine writes checkpoints")
    processes: list[ProcessRecord] = Field(default_factory=list)
    # The Tinker API key of this run: never written to cluster.json or logged.
    api_key: SecretStr = Field(default_factory=lambda: SecretStr("tml-" + secrets.token_hex(16)), exclude=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.api_port}"

    @property
    def coordinator_address(self) -> str | None:
        return f"{self.host}:{self.coordinator_port}" if self.coordinator_port else None

    @property
    def path(self) -> Path:
        return Path(self.state_dir) / "cluster.json"

    def rank(self, rank: int) -> ProcessRecord | None:
        return next((p for p in self.processes if p.rank == rank), None)

    def log_path(self, name: str) -> Path:
        return Path(self.state_dir) / "logs" / f"{name}.log"

    def save(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(self.model_dump_json(indent=2))
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, state_dir: str | Path) -> Cluster:
        return cls.model_validate_json((Path(state_dir) / "cluster.json").read_text())


class Launcher(ABC):
    """Places the processes of a cluster."""

    @abstractmethod
    def start(self, cluster: Cluster, role: Role, rank: int | None, cmd: list[str], env: dict[str, str],
              ports: dict[str, int], log_name: str) -> ProcessRecord:
        """Start one process and record it in cluster.json before returning."""

    @abstractmethod
    def exit_code(self, record: ProcessRecord) -> int | None:
        """None while the process runs, else its exit code (negative: killed by that signal)."""

    @abstractmethod
    def stop(self, cluster: Cluster, grace_s: float = 5.0) -> list[ProcessRecord]:
        """Stop every process of the cluster; returns the records with exit codes."""


ISOLATE_WORKER_DISKS_ENV = "TXFLOW_ISOLATE_WORKER_DISKS"


class LocalLauncher(Launcher):
    """Every process a subprocess of this machine, each in its own process group.

    With `TXFLOW_ISOLATE_WORKER_DISKS=1` (Linux, root), each worker rank runs in
    its own mount namespace where the run's state directory, staging included,
    is an empty private tmpfs: the ranks share no run files, as on separate
    nodes. This is how the tests prove checkpoints need no shared filesystem.
    """

    name = "local"

    def __init__(self) -> None:
        self._popen: dict[int, subprocess.Popen] = {}
        self.isolate_worker_disks = os.environ.get(ISOLATE_WORKER_DISKS_ENV) == "1"

    def start(self, cluster, role, rank, cmd, env, ports, log_name):
        log = cluster.log_path(log_name)
        if role == "worker" and self.isolate_worker_disks:
            cmd = private_disk_command(cluster.state_dir, cmd)
        proc = processes.spawn(cmd, log, env=env)
        self._popen[proc.pid] = proc
        record = ProcessRecord(
            role=role, rank=rank, pid=proc.pid, pgid=proc.pid, start_time=processes.start_time(proc.pid),
            host=cluster.host, ports=ports, log=str(log),
        )
        cluster.processes.append(record)
        cluster.save()
        return record

    def exit_code(self, record):
        proc = self._popen.get(record.pid)
        if proc is not None:
            return proc.poll()
        # Not started by this launcher instance (e.g. a cancellation hook): liveness only.
        return None if processes.is_alive(record.pid, record.start_time) else -1

    def stop(self, cluster, grace_s=5.0):
        ours = [r for r in cluster.processes if r.pid in self._popen or processes.is_alive(r.pid, r.start_time)]
        processes.stop_groups([r.pgid for r in ours], grace_s)
        for record in cluster.processes:
            proc = self._popen.pop(record.pid, None)
            if proc is not None:
                record.exit_code = proc.wait(timeout=5)
            elif record.exit_code is None and not processes.is_alive(record.pid, record.start_time):
                record.exit_code = -9
        cluster.save()
        return cluster.processes


def private_disk_command(directory: str, cmd: list[str]) -> list[str]:
    """`cmd` in a new mount namespace where `directory` is an empty tmpfs; `unshare` and `sh` exec, so
    the pid stays the command's. The first log line says what the rank sees there."""
    script = ('mount -t tmpfs txflow-node-disk "$0" || exit 97; '
              'echo "txflow: private node disk: $0 holds $(ls -A "$0" | wc -l) entries"; exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, directory, *cmd]


def stop_cluster(state_dir: str | Path, launcher: Launcher | None = None, grace_s: float = 5.0) -> list[ProcessRecord]:
    """Stop the cluster recorded in `state_dir/cluster.json` (no-op when there is none)."""
    path = Path(state_dir) / "cluster.json"
    if not path.exists():
        return []
    cluster = Cluster.load(state_dir)
    return (launcher or LocalLauncher()).stop(cluster, grace_s)


def exited(cluster: Cluster, launcher: Launcher, skip: set[int] = frozenset()) -> list[tuple[ProcessRecord, int]]:
    """(record, exit code) of every process of the cluster that has exited, pids in `skip` aside.

    A JAX rank whose peer vanished mid-collective aborts (SIGABRT) within a
    second, so when several are found at once the other deaths come first:
    they are the cause.
    """
    found = []
    for record in list(cluster.processes):
        code = None if record.pid in skip else launcher.exit_code(record)
        if code is not None:
            record.exit_code = code
            found.append((record, code))
    return sorted(found, key=lambda item: item[1] == -signal.SIGABRT)


def describe_exit(record: ProcessRecord, code: int) -> str:
    """A sentence about a process that exited, with the tail of its log."""
    name = f"rank {record.rank} ({record.role})" if record.rank is not None else record.role
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"{name}, pid {record.pid}, {how}. Last lines of {record.log}:\n{processes.tail(record.log)}"


def as_json(records: list[ProcessRecord]) -> list[dict]:
    return [json.loads(r.model_dump_json(include={"rank", "role", "pid", "exit_code"})) for r in records]
