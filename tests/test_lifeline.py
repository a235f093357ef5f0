"""Children die with the process that started them (txflow.processes.lifeline), whatever kills it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from txflow.processes import lifeline, procfs

pytestmark = [pytest.mark.timed]

# A parent that starts `child_code` the way the launchers do (its own session, the lifeline
# variable set), from a worker thread that then ends, as Prefect's task threads do; it prints
# the child's pid and start time, then sleeps until killed.
PARENT = textwrap.dedent("""
    import json, sys, threading, time
    from txflow.processes import groups, lifeline, procfs
    from pathlib import Path
    out = {}
    def start():
        proc = groups.spawn(json.loads(sys.argv[1]), Path(sys.argv[2]),
                            env=lifeline.child_env(dict(__import__('os').environ)))
        out["pid"], out["start"] = proc.pid, procfs.start_time(proc.pid)
    t = threading.Thread(target=start); t.start(); t.join()
    print(json.dumps(out), flush=True)
    time.sleep(300)
""")
WATCHING_CHILD = [sys.executable, "-c", "from txflow.processes import lifeline; import time; lifeline.watch_parent(); "
                  "print('watching', flush=True); time.sleep(300)"]


def start_parent(tmp_path: Path, child: list[str]) -> tuple[subprocess.Popen, int, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, json.dumps(child), str(tmp_path / "child.log")],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    info = json.loads(parent.stdout.readline())
    return parent, info["pid"], info["start"]


def wait_gone(pid: int, started: int, timeout_s: float) -> float:
    began = time.monotonic()
    while procfs.is_alive(pid, started):
        assert time.monotonic() - began < timeout_s, f"pid {pid} still alive after {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - began


def kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture
def cleanup():
    pids: list[int] = []
    yield pids
    for pid in pids:
        kill(pid)


def test_a_watching_child_dies_within_a_second_of_its_parents_sigkill(tmp_path, cleanup):
    parent, child, started = start_parent(tmp_path, WATCHING_CHILD)
    cleanup += [parent.pid, child]
    deadline = time.monotonic() + 10
    while "watching" not in (tmp_path / "child.log").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.5)
    assert procfs.is_alive(child, started)  # the forking thread ended, the child lives on
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert wait_gone(child, started, timeout_s=5) < 1.0
    assert f"parent process {parent.pid} is gone" in (tmp_path / "child.log").read_text()


def test_a_program_under_the_guard_dies_with_the_guards_parent(tmp_path, cleanup):
    grandchild_pid = tmp_path / "program.pid"
    program = ["sh", "-c", f'echo $$ > {grandchild_pid}; exec sleep 300']
    parent, guard, started = start_parent(tmp_path, lifeline.guarded(program))
    cleanup += [parent.pid, guard]
    deadline = time.monotonic() + 10
    while not grandchild_pid.exists() or not grandchild_pid.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pid = int(grandchild_pid.read_text())
    program_started = procfs.start_time(pid)
    assert os.getpgid(pid) == guard  # the program runs in the guard's process group
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    wait_gone(guard, started, timeout_s=5)
    wait_gone(pid, program_started, timeout_s=5)


def test_the_guard_exits_as_its_program_did(tmp_path):
    env = lifeline.child_env(dict(os.environ))
    assert subprocess.run(lifeline.guarded([sys.executable, "-c", "import sys; sys.exit(3)"]), env=env).returncode == 3
    killed = subprocess.run(lifeline.guarded([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]), env=env)
    assert killed.returncode == -signal.SIGKILL


def test_a_grandchild_does_not_inherit_the_parent_pid():
    code = ("from txflow.processes import lifeline; import os, sys; lifeline.watch_parent(); "
            "sys.stdout.write(repr(os.environ.get(lifeline.PARENT_ENV)))")
    result = subprocess.run([sys.executable, "-c", code], env=lifeline.child_env(dict(os.environ)),
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout == "None"


def test_a_child_whose_parent_is_already_gone_stops_at_once(tmp_path):
    """The recorded pid may be reused by then: only the real parent counts."""
    env = {**os.environ, lifeline.PARENT_ENV: str(os.getpid() + 100_000)}  # not our parent
    began = time.monotonic()
    result = subprocess.run(WATCHING_CHILD, env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == -signal.SIGKILL and time.monotonic() - began < 10
    assert "is gone" in result.stderr
