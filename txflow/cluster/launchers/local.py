"""The local launcher: every process a subprocess of this machine, each in its own
process group, each dying with the process that started it (`txflow.processes.lifeline`)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from txflow.cluster.launcher import Launcher, LostProcess
from txflow.cluster.records import Cluster, ProcessRecord
from txflow.config import environ_without_secrets
from txflow.processes import groups, lifeline, logs, procfs
from txflow.processes.ports import LISTEN_FD_ENV, free_port, listener

ISOLATE_WORKER_DISKS_ENV = "TXFLOW_ISOLATE_WORKER_DISKS"


class LocalLauncher(Launcher):
    """Subprocesses of this machine, logs under `<state_dir>/logs`, ports picked on the configured interface
    (the API's bound here and inherited by the API, see `Launcher.place`).

    With `TXFLOW_ISOLATE_WORKER_DISKS=1` (Linux, root), each worker rank runs in
    its own mount namespace where the run's state directory, staging included,
    is an empty private tmpfs: the ranks share no run files, as on separate
    nodes. This is how the tests prove checkpoints need no shared filesystem.
    """

    name = "local"

    def __init__(self) -> None:
        self._popen: dict[int, subprocess.Popen] = {}
        self.isolate_worker_disks = os.environ.get(ISOLATE_WORKER_DISKS_ENV) == "1"
        self._api_socket: socket.socket | None = None  # bound by place, handed to the API by start

    def place(self, cluster: Cluster, host: str) -> None:
        self._close_api_socket()
        self._api_socket = listener(host)
        cluster.host = host
        cluster.api_port = self._api_socket.getsockname()[1]
        # jax.distributed binds the coordinator's port itself: picked free here, it can be taken before
        # rank 0 binds it (docs/security.md, "What a run protects against").
        cluster.coordinator_port = free_port(host) if cluster.num_processes > 1 else None
        cluster.save()

    def start(self, cluster, role, rank, cmd, env, ports, log_name, secret_env=None):
        log = Path(cluster.state_dir) / "logs" / f"{log_name}.log"
        if role == "worker" and self.isolate_worker_disks:
            cmd = private_disk_command(cluster.state_dir, cmd)
        full_env = {**environ_without_secrets(), **env, **(secret_env or {})}
        inherited: tuple[int, ...] = ()
        if role == "api" and self._api_socket is not None:
            inherited = (self._api_socket.fileno(),)
            full_env[LISTEN_FD_ENV] = str(inherited[0])
        try:
            proc = groups.spawn(cmd, log, env=lifeline.child_env(full_env), pass_fds=inherited)
        finally:
            if inherited:
                self._close_api_socket()  # the API holds it now; this process never accepts on it
        self._popen[proc.pid] = proc
        record = ProcessRecord(
            role=role, rank=rank, pid=proc.pid, pgid=proc.pid, start_time=procfs.start_time(proc.pid),
            host=cluster.host, ports=ports, log=str(log),
        )
        cluster.processes.append(record)
        cluster.save()
        return record

    def exit_code(self, record):
        proc = self._popen.get(record.pid)
        if proc is not None:
            return proc.poll()
        # Not started by this launcher instance (e.g. a cancellation hook): liveness only, no exit code.
        if procfs.is_alive(record.pid, record.start_time):
            return None
        raise LostProcess(f"{record.name} is gone; its exit code is unknown here (another process started it)")

    def tail(self, record, lines=30):
        return logs.tail(record.log, lines)

    def _close_api_socket(self) -> None:
        if self._api_socket is not None:
            self._api_socket.close()
            self._api_socket = None

    def stop(self, cluster, grace_s=5.0):
        self._close_api_socket()  # placed, never started
        ours = [r for r in cluster.processes if r.pid in self._popen or procfs.is_alive(r.pid, r.start_time)]
        groups.stop_groups([r.pgid for r in ours], grace_s)
        for record in cluster.processes:
            proc = self._popen.pop(record.pid, None)
            if proc is not None:
                try:
                    record.exit_code = proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    # SIGKILL takes a process only when it leaves the kernel: one in uninterruptible sleep (a
                    # hung disk or mount) stays. Name it and go on, so the run still ends with its report.
                    self._popen[record.pid] = proc
                    record.unstoppable = True
            elif record.exit_code is None and not procfs.is_alive(record.pid, record.start_time):
                record.exit_unknown = True  # only its parent could have learned it
        cluster.save()
        return cluster.processes


def private_disk_command(directory: str, cmd: list[str]) -> list[str]:
    """`cmd` in a new mount namespace where `directory` is an empty tmpfs; `unshare` and `sh` exec, so
    the pid stays the command's. The first log line says what the rank sees there."""
    script = ('mount -t tmpfs txflow-node-disk "$0" || exit 97; '
              'echo "txflow: private node disk: $0 holds $(ls -A "$0" | wc -l) entries"; exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, directory, *cmd]
