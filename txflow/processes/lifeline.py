"""Children that die with the process that started them.

Every process of a cluster runs in its own session, so that teardown can stop
it as a group; the price is that it outlives a parent that dies without
running any code (SIGKILL, the OOM killer, a lost Prefect worker). So each
child watches its parent itself: the parent passes its pid in
`TXFLOW_PARENT_PID`, and a daemon thread in the child waits on a pidfd of that
pid and, when it exits, kills the child's whole process group. Nothing needs
to run in the dead parent, and no sweeper has to be alive.

A pidfd, not `PR_SET_PDEATHSIG`: that signal fires when the *thread* that
forked the child exits, and Prefect runs tasks in worker threads.

Our own entry points (the SkyRL-tx API, engine and workers) call
`watch_parent()` first thing. Programs we do not control (a user's Tinker
client, the embedded Prefect server) run under `python -m txflow.processes.lifeline CMD
...`, a small guard that watches its parent, runs CMD as its child in the same
process group, and exits as CMD did.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading

from txflow.processes.ports import LISTEN_FD_ENV

PARENT_ENV = "TXFLOW_PARENT_PID"


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child that must die with this process."""
    return {**env, PARENT_ENV: str(os.getpid())}


def guarded(cmd: list[str]) -> list[str]:
    """`cmd` run under the guard, for a program that cannot call `watch_parent` itself."""
    return [sys.executable, "-m", "txflow.processes.lifeline", *cmd]


def watch_parent() -> int | None:
    """Kill this process group when the parent named in `TXFLOW_PARENT_PID` exits; returns that pid.

    The variable is removed from this process's environment, so that a grandchild
    does not mistake this process's parent for its own.
    """
    value = os.environ.pop(PARENT_ENV, None)
    if not value:
        return None
    parent = int(value)
    threading.Thread(target=_watch, args=(parent,), name="txflow-lifeline", daemon=True).start()
    return parent


def _watch(parent: int) -> None:
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:
        _die(parent)
        return
    # The pid may already belong to another process: only our real parent counts.
    if os.getppid() != parent:
        _die(parent)
        return
    select.select([fd], [], [])  # readable once the process exits
    _die(parent)


def _die(parent: int) -> None:
    group = os.getpgrp()
    sys.stderr.write(f"txflow: parent process {parent} is gone; stopping process group {group}\n")
    sys.stderr.flush()
    if group == os.getpid():
        os.killpg(group, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    """The guard: watch the parent, run `argv` as a child in this process group, exit as it did. A
    listening socket this guard inherited (`ports.LISTEN_FD_ENV`) is the program's: it stays open in it."""
    if not argv:
        sys.exit("usage: python -m txflow.processes.lifeline CMD [ARG ...]")
    watch_parent()
    listening = os.environ.get(LISTEN_FD_ENV)
    child = subprocess.Popen(argv, pass_fds=(int(listening),) if listening else ())
    # SIGTERM to the guard alone (not its group) still reaches the program.
    signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    if code < 0:  # die by the same signal, so the exit code the launcher records is the program's
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
