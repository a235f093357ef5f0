"""`custom` mode: the user's own Tinker client program as the train step."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from txflow.cluster.records import Cluster
from txflow.config import environ_without_secrets
from txflow.processes import groups, lifeline, logs
from txflow.training import sft

PLACEHOLDERS = ("base_url", "base_model", "run_id", "checkpoint_root")


@dataclass
class CustomData:
    command: list[str]
    probe: list[sft.Example]  # a small batch for the forward pass that proves a restored state works


def is_module(client: str) -> bool:
    """Whether `--client` names a module (run with -m) rather than a .py path."""
    return not (client.endswith(".py") or os.sep in client)


def client_command(client: str, python: str | None = None) -> list[str]:
    """How to start the client under `python` (default: this interpreter): a .py path, else a module with -m.

    A module is looked up here only for this interpreter; preflight asks another interpreter itself.
    """
    interpreter = python or sys.executable
    if not is_module(client):
        path = Path(client).expanduser()
        if not path.is_file():
            raise ValueError(f"--client {client}: no such file")
        return [interpreter, str(path.absolute())]
    if python is None and importlib.util.find_spec(client) is None:
        raise ValueError(f"--client {client}: neither a .py file nor an importable module")
    return [interpreter, "-m", client]


def fill(args: list[str], values: dict[str, str]) -> list[str]:
    """Replace {base_url}, {base_model}, {run_id} and {checkpoint_root}; other braces stay as they are."""
    out = []
    for arg in args:
        for key in PLACEHOLDERS:
            arg = arg.replace("{" + key + "}", values[key])
        out.append(arg)
    return out


class ClientFailed(RuntimeError):
    """The custom client exited with a non-zero status."""


def run_client(command: list[str], env: dict[str, str], log_path: Path, handle, emit, poll_s: float = 0.2) -> float:
    """Run the client to completion; its output goes to `log_path` and, line by line, to `emit`.

    A rank that dies meanwhile (the monitor says so) stops the client and fails the step at once.
    The client runs under the lifeline guard, so it dies with this process too.
    """
    began = time.monotonic()
    proc = groups.spawn(lifeline.guarded(command), log_path, env=lifeline.child_env(env))
    sent = 0
    try:
        while True:
            code = proc.poll()
            sent = _forward_new_lines(log_path, sent, emit)
            if code is not None:
                break
            handle.monitor.raise_if_failed()
            time.sleep(poll_s)
    finally:
        if proc.poll() is None:
            groups.stop_groups([proc.pid], grace_s=2.0)
        proc.wait()
    if proc.returncode != 0:
        raise ClientFailed(f"the custom client exited with code {proc.returncode}. Last lines of {log_path}:\n"
                           f"{logs.tail(log_path)}")
    return time.monotonic() - began


def _forward_new_lines(path: Path, offset: int, emit) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    complete = data.rfind(b"\n") + 1
    for line in data[:complete].decode("utf-8", errors="replace").splitlines():
        emit(f"client: {line}")
    return offset + complete


def client_env(cluster: Cluster) -> dict[str, str]:
    """The client's environment: this process's without the run's credentials, plus the cluster's URL and
    key (the one credential it uses). A Python client that dies of a signal (SIGSEGV, SIGABRT: a native
    library, or an SDK's thread at interpreter exit) writes every thread's stack to its log first, unless
    this environment sets PYTHONFAULTHANDLER itself."""
    env = environ_without_secrets()
    env.update(TINKER_BASE_URL=cluster.base_url, TINKER_API_KEY=cluster.api_key.get_secret_value(),
               PYTHONUNBUFFERED="1")
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env
