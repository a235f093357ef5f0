"""Process groups, stopping, liveness and ports (txflow.processes), and the local launcher's cluster.json."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from txflow.cluster.launchers import stop_cluster
from txflow.cluster.launchers.local import LocalLauncher
from txflow.cluster.records import Cluster
from txflow.processes import groups, logs, ports, procfs

pytestmark = [pytest.mark.timed]

SLEEP = [sys.executable, "-c", "import time; time.sleep(300)"]
# Leader and grandchild both ignore SIGTERM (an ignored disposition survives exec).
TERM_IGNORING_TREE = 'trap "" TERM; sleep 300 & echo $! > "$0"; wait'


@pytest.fixture
def spawned():
    """spawn() that SIGKILLs and reaps every group it started when the test ends, passed or not."""
    started: list[subprocess.Popen] = []

    def spawn(cmd, log_path, **kwargs):
        proc = groups.spawn(cmd, log_path, **kwargs)
        started.append(proc)
        return proc

    yield spawn
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


# --- spawn ---------------------------------------------------------------------


def test_spawned_child_leads_its_own_process_group(tmp_path, spawned):
    proc = spawned(SLEEP, tmp_path / "child.log")
    assert os.getpgid(proc.pid) == proc.pid
    assert os.getpgid(proc.pid) != os.getpgid(0)
    assert os.getsid(proc.pid) == proc.pid


def test_spawn_appends_stdout_and_stderr_to_the_log(tmp_path, spawned):
    log = tmp_path / "logs" / "child.log"  # parent directory created by spawn
    log.parent.mkdir()
    log.write_text("earlier run\n")
    code = "import sys; print('to stdout', flush=True); print('to stderr', file=sys.stderr, flush=True)"
    assert spawned([sys.executable, "-c", code], log).wait(timeout=30) == 0
    assert log.read_text().splitlines() == ["earlier run", "to stdout", "to stderr"]


def test_spawn_creates_the_log_directory(tmp_path, spawned):
    log = tmp_path / "a" / "b" / "child.log"
    assert spawned([sys.executable, "-c", "print('hi')"], log).wait(timeout=30) == 0
    assert log.read_text() == "hi\n"


# --- stop_groups ------------------------------------------------------------


def test_stop_groups_kills_a_group_whose_leader_and_grandchild_ignore_sigterm(tmp_path, spawned):
    pidfile = tmp_path / "grandchild.pid"
    leader = spawned(["bash", "-c", TERM_IGNORING_TREE, str(pidfile)], tmp_path / "tree.log")
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip())
    grandchild = int(pidfile.read_text())
    grandchild_started = procfs.start_time(grandchild)
    assert os.getpgid(grandchild) == leader.pid
    # The trap is in place before the pid file is written: SIGTERM alone must not stop it.
    os.killpg(leader.pid, signal.SIGTERM)
    time.sleep(0.3)
    assert leader.poll() is None and procfs.is_alive(grandchild, grandchild_started)

    grace = 1.0
    began = time.monotonic()
    groups.stop_groups([leader.pid], grace_s=grace)
    elapsed = time.monotonic() - began

    assert elapsed < grace + 3
    assert not groups.group_alive(leader.pid)
    assert leader.wait(timeout=5) == -signal.SIGKILL
    assert not procfs.is_alive(grandchild, grandchild_started)


def test_stop_groups_returns_as_soon_as_groups_exit_on_sigterm(tmp_path, spawned):
    procs = [spawned(SLEEP, tmp_path / f"p{i}.log") for i in range(2)]
    grace = 10.0
    began = time.monotonic()
    groups.stop_groups([p.pid for p in procs], grace_s=grace)
    elapsed = time.monotonic() - began

    assert elapsed < 3.0 < grace
    assert [p.wait(timeout=5) for p in procs] == [-signal.SIGTERM, -signal.SIGTERM]
    assert not any(groups.group_alive(p.pid) for p in procs)


def test_stop_groups_ignores_groups_that_are_already_gone(tmp_path, spawned):
    proc = spawned([sys.executable, "-c", "pass"], tmp_path / "p.log")
    proc.wait(timeout=30)
    began = time.monotonic()
    groups.stop_groups([proc.pid], grace_s=5.0)
    assert time.monotonic() - began < 1.0


# --- liveness ------------------------------------------------------------------


def test_is_alive_tells_a_reused_pid_apart_by_its_start_time(tmp_path, spawned):
    proc = spawned(SLEEP, tmp_path / "p.log")
    started = procfs.start_time(proc.pid)
    assert started is not None
    assert procfs.is_alive(proc.pid)
    assert procfs.is_alive(proc.pid, started)
    assert not procfs.is_alive(proc.pid, started + 1)
    assert not procfs.is_alive(proc.pid, started - 1)


def test_a_zombie_is_not_alive(tmp_path, spawned):
    proc = spawned(SLEEP, tmp_path / "p.log")
    started = procfs.start_time(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    wait_for(lambda: not procfs.is_alive(proc.pid, started))  # exited, not reaped yet
    assert not groups.group_alive(proc.pid)
    assert proc.wait(timeout=5) == -signal.SIGKILL


def test_a_pid_that_does_not_exist_is_not_alive():
    assert procfs.start_time(2**22 + 1) is None  # above the kernel's pid_max limit
    assert not procfs.is_alive(2**22 + 1)
    assert not groups.group_alive(2**22 + 1)


# --- tail, ports -----------------------------------------------------------------


@pytest.mark.parametrize("lines", [1, 5, 30])
def test_tail_returns_the_last_lines(tmp_path, lines):
    path = tmp_path / "x.log"
    path.write_text("".join(f"line {i}\n" for i in range(1, 101)))
    assert logs.tail(path, lines) == "\n".join(f"line {i}" for i in range(101 - lines, 101))


def test_tail_of_a_large_file_returns_its_last_lines(tmp_path):
    path = tmp_path / "big.log"
    path.write_text("".join(f"{i:08d} {'x' * 100}\n" for i in range(5000)))  # ~540 KB
    assert logs.tail(path, 3).splitlines() == [f"{i:08d} {'x' * 100}" for i in (4997, 4998, 4999)]


def test_tail_of_a_short_file_returns_all_of_it(tmp_path):
    path = tmp_path / "x.log"
    path.write_text("a\nb\n")
    assert logs.tail(path, 30) == "a\nb"


def test_tail_of_a_missing_file_is_empty(tmp_path):
    assert logs.tail(tmp_path / "missing.log") == ""


def test_free_port_can_be_bound_on_loopback():
    port = ports.free_port("127.0.0.1")
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))


def test_port_open_while_a_socket_listens_and_not_after_it_closes():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert ports.port_open("127.0.0.1", port)
    finally:
        server.close()
    assert not ports.port_open("127.0.0.1", port)


# --- LocalLauncher and cluster.json ---------------------------------------------


def make_cluster(state_dir: Path) -> Cluster:
    state_dir.mkdir(parents=True, exist_ok=True)
    return Cluster(run_id="unit", launcher="local", state_dir=str(state_dir), host="127.0.0.1", api_port=1,
                   coordinator_port=None, num_processes=1, base_model_path="x", checkpoints_base="y")


@pytest.fixture
def local_cluster(tmp_path):
    """A Cluster and the LocalLauncher that starts its processes; both stopped and reaped at the end."""
    cluster = make_cluster(tmp_path / "state")
    launcher = LocalLauncher()
    popens = launcher._popen  # the Popen objects, to reap them whatever stopped them
    yield cluster, launcher
    stop_cluster(cluster.state_dir, grace_s=1.0)
    for proc in list(popens.values()):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def test_local_launcher_records_each_process_in_cluster_json_without_the_api_key(local_cluster):
    cluster, launcher = local_cluster
    first = launcher.start(cluster, "coordinator", 0, SLEEP, dict(os.environ), {"coordinator": 1234}, "rank0")
    on_disk = json.loads(cluster.path.read_text())
    assert [p["pid"] for p in on_disk["processes"]] == [first.pid]  # recorded before start() returns

    second = launcher.start(cluster, "worker", 1, SLEEP, dict(os.environ), {}, "rank1")
    text = cluster.path.read_text()
    on_disk = json.loads(text)
    assert [(p["role"], p["rank"], p["pid"]) for p in on_disk["processes"]] == [
        ("coordinator", 0, first.pid),
        ("worker", 1, second.pid),
    ]
    for record in on_disk["processes"]:
        assert record["pgid"] == record["pid"] == os.getpgid(record["pid"])
        assert record["start_time"] == procfs.start_time(record["pid"])
        assert Path(record["log"]) == Path(cluster.state_dir) / "logs" / f"rank{record['rank']}.log"
        assert Path(record["log"]).exists()
        assert record["exit_code"] is None
    assert on_disk["processes"][0]["ports"] == {"coordinator": 1234}
    assert "api_key" not in on_disk
    assert cluster.api_key.get_secret_value() not in text
    assert launcher.exit_code(first) is None and launcher.exit_code(second) is None


def test_stop_cluster_from_cluster_json_alone_stops_every_process(local_cluster):
    """What a cancellation hook in another process does: it has only the state directory."""
    cluster, launcher = local_cluster
    records = [launcher.start(cluster, role, rank, SLEEP, dict(os.environ), {}, f"rank{rank}")
               for role, rank in (("coordinator", 0), ("worker", 1))]
    assert all(procfs.is_alive(r.pid, r.start_time) for r in records)

    stopped = stop_cluster(cluster.state_dir, LocalLauncher(), grace_s=2.0)

    assert sorted(r.pid for r in stopped) == sorted(r.pid for r in records)
    for record in records:
        assert not procfs.is_alive(record.pid, record.start_time)
        assert not groups.group_alive(record.pgid)
    # The hook did not start them, so it cannot learn their exit codes: it says so instead of inventing one.
    on_disk = json.loads(cluster.path.read_text())
    assert all(p["exit_code"] is None and p["exit_unknown"] for p in on_disk["processes"])
    assert {r.exit_text for r in stopped} == {"unknown"}
    # The launcher that started them sees them gone too.
    assert all(launcher.exit_code(r) is not None for r in records)


def test_stop_by_the_starting_launcher_records_the_real_exit_codes(local_cluster):
    cluster, launcher = local_cluster
    launcher.start(cluster, "coordinator", 0, SLEEP, dict(os.environ), {}, "rank0")
    stopped = launcher.stop(cluster, grace_s=2.0)
    assert [r.exit_code for r in stopped] == [-signal.SIGTERM]
    assert json.loads(cluster.path.read_text())["processes"][0]["exit_code"] == -signal.SIGTERM


def test_stop_cluster_without_cluster_json_is_a_no_op(tmp_path):
    assert stop_cluster(tmp_path / "never-started") == []


def test_private_disk_command_gives_the_process_an_empty_directory_of_its_own(tmp_path):
    from tests.helpers import private_mounts_work
    from txflow.cluster.launchers.local import private_disk_command

    if not private_mounts_work():
        pytest.skip("unshare --mount is not permitted on this machine")
    (tmp_path / "shared.txt").write_text("on the coordinator's disk")
    cmd = private_disk_command(str(tmp_path), ["sh", "-c", f"ls -A {tmp_path}; touch {tmp_path}/rank1.txt"])
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"txflow: private node disk: {tmp_path} holds 0 entries"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared.txt"]  # what the rank wrote stayed private


# A stand-in for the API: it serves on the socket it inherited and answers each connection with its pid.
SERVE_INHERITED = [sys.executable, "-c", "import os\nfrom txflow.processes import ports\n"
                   "sock = ports.inherited_listener()\nwhile True:\n    conn, _ = sock.accept()\n"
                   "    conn.sendall(str(os.getpid()).encode())\n    conn.close()"]


def test_the_api_port_stays_bound_from_its_pick_until_the_api_serves_on_that_very_socket(local_cluster):
    """No gap for another local user to bind the port first and receive the requests (the readiness
    request carries the run's key): the launcher binds it in `place`, the API inherits the socket."""
    cluster, launcher = local_cluster
    launcher.place(cluster, "127.0.0.1")
    port = cluster.api_port
    for reuse in (socket.SO_REUSEADDR, socket.SO_REUSEPORT):  # a squatter's best tries
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, reuse, 1)
            with pytest.raises(OSError, match="Address already in use"):
                squatter.bind(("127.0.0.1", port))
    api = launcher.start(cluster, "api", None, SERVE_INHERITED, {}, {"http": port}, "api")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        assert conn.recv(64) == str(api.pid).encode()  # served by the API itself
    assert launcher._api_socket is None  # only the API holds it now
    launcher.stop(cluster, grace_s=1.0)
    with socket.socket() as after:  # and nothing else did: the port is free once the API is gone
        # SO_REUSEADDR: the API closed the connection first, so the port may be in TIME_WAIT (not held);
        # a socket still listening on it would refuse this bind all the same.
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind(("127.0.0.1", port))


def test_a_placed_api_socket_that_was_never_started_is_closed_by_stop(local_cluster):
    cluster, launcher = local_cluster
    launcher.place(cluster, "127.0.0.1")
    launcher.stop(cluster, grace_s=1.0)
    with socket.socket() as again:
        again.bind(("127.0.0.1", cluster.api_port))


def environ_of(pid: int) -> dict[str, str]:
    # Until the child has exec'd, /proc shows the environment it forked with (the parent's), so wait
    # for the program's own command line first.
    deadline = time.monotonic() + 10
    while b"time.sleep(300)" not in Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, f"pid {pid} never exec'd its program"
        time.sleep(0.02)
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_credentials_reach_only_the_process_given_them_and_only_by_environment(local_cluster, monkeypatch):
    cluster, launcher = local_cluster
    # The orchestrator's own credential variables (how the user gave them) are inherited by no child.
    monkeypatch.setenv("TINKER_API_KEY", "tml-env-MARKER")
    monkeypatch.setenv("TXFLOW_DATABASE_URL", "postgresql://u:env-MARKER@/db")
    monkeypatch.setenv("TXFLOW_STORAGE_OPTIONS", '{"secret": "env-MARKER"}')
    rank0 = launcher.start(cluster, "coordinator", 0, SLEEP, {"PLAIN": "1"}, {}, "rank0",
                           secret_env={"TX_DATABASE_URL": "postgresql://u:given-MARKER@/db"})
    worker = launcher.start(cluster, "worker", 1, SLEEP, {"PLAIN": "1"}, {}, "rank1")
    env0, env1 = environ_of(rank0.pid), environ_of(worker.pid)
    assert env0["TX_DATABASE_URL"] == "postgresql://u:given-MARKER@/db" and env0["PLAIN"] == env1["PLAIN"] == "1"
    assert [k for k, v in env0.items() if "env-MARKER" in v] == []
    assert [k for k, v in env1.items() if "MARKER" in v] == []
    for pid in (rank0.pid, worker.pid):
        assert b"MARKER" not in Path(f"/proc/{pid}/cmdline").read_bytes()
