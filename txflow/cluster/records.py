"""The run's cluster as a record: which processes exist, and where.

`cluster.json` in the run's local state directory is the record of truth: it
is written as soon as a process exists, and teardown works from it alone, so a
cancellation hook or another process can stop a run's cluster too. How
processes are started, watched and stopped is a launcher's business
(`txflow.cluster.launcher`): this module knows no pids to kill and no /proc.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr

Role = Literal["coordinator", "worker", "api"]


class ProcessRecord(BaseModel):
    """One process of the cluster, as written to cluster.json."""

    role: Role
    rank: int | None = Field(description="JAX process index; None for the API server")
    pid: int = Field(description="Process id on its node")
    pgid: int | None = None
    start_time: int | None = Field(default=None, description="Kernel start time, to tell pid reuse apart")
    host: str
    ports: dict[str, int] = Field(default_factory=dict)
    log: str = Field(description="Log file on the process's node")
    node_id: str | None = Field(default=None, description="The node the launcher placed it on, where it has one")
    actor: str | None = Field(default=None, description="Name of the Ray actor that runs it (ray launcher)")
    exit_code: int | None = None
    exit_unknown: bool = Field(default=False, description="Gone, but its exit code could not be learned (another "
                               "process started it, or its node or actor was lost)")
    unstoppable: bool = Field(default=False, description="Still there after SIGKILL (a process in uninterruptible "
                              "sleep): left behind, and named in the report")

    @property
    def exit_text(self) -> str:
        """Its exit code as a log line says it: a number, `unknown`, `running`, or that SIGKILL did not take."""
        if self.unstoppable:
            return "still running after SIGKILL (uninterruptible sleep?)"
        if self.exit_unknown:
            return "unknown"
        return "running" if self.exit_code is None else str(self.exit_code)

    @property
    def name(self) -> str:
        return f"rank {self.rank} ({self.role})" if self.rank is not None else self.role


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
    launcher_state: dict = Field(default_factory=dict,
                                 description="What the launcher needs to find and stop the cluster again")
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

    def save(self) -> None:
        # 0600 whatever the caller's umask: a `txflow stop` from a shell rewrites it too.
        tmp = self.path.with_suffix(".json.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.model_dump_json(indent=2))
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, state_dir: str | Path) -> Cluster:
        return cls.model_validate_json((Path(state_dir) / "cluster.json").read_text())


def describe_exit(record: ProcessRecord, code: int | None, log_tail: str, cause: str | None = None) -> str:
    """A sentence about a process that exited, with the tail of its log."""
    if cause:
        how = cause
    elif code is None:
        how = "is gone"
    else:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return f"{record.name}, pid {record.pid}, {how}. Last lines of {record.log}:\n{log_tail}"


def as_json(records: list[ProcessRecord]) -> list[dict]:
    """What the report says of each process: rank, role, pid, exit code and its node."""
    return [{"rank": r.rank, "role": r.role, "pid": r.pid, "exit_code": r.exit_code,
             "exit_unknown": r.exit_unknown, "unstoppable": r.unstoppable, "node_id": r.node_id,
             "node_ip": r.host} for r in records]
