"""A real two-node Ray cluster for tests, sealed in a private network namespace.

Ray binds every interface whatever `--node-ip-address` says, so each cluster
lives in its own network namespace whose only interface is loopback: nothing
it opens is reachable from outside, and two test clusters never collide on a
port. Inside it:

- node 0, the head: `ray start --head --block`, state under `<base>/head`;
- node 1..n: `ray start --address 127.0.0.1:<port> --block`, each in its own
  mount namespace where `<base>/node<i>` is an empty tmpfs (what
  `txflow.cluster.launchers.local.private_disk_command` does for a rank): it shares no disk
  with the head, as on a real second machine.

Every process the cluster starts is in the namespace, so "every pid in the
namespace" is the cluster: teardown SIGTERMs the nodes' process groups, then
SIGKILLs whatever is left in the namespace, deletes it, and checks that no
process remains in it or in a node's mount namespace (which unmounts the
tmpfs). Nothing here depends on pytest; `running_cluster` at the bottom is the
shape of a fixture.

Needs root (namespaces, mounts) and `ip`, `unshare`, `nsenter` on Linux.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

RAY_PORT = 6379

# Ray's own knobs for a quiet, self-contained test cluster.
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    "PYTHONUNBUFFERED": "1",
}

# Polls the GCS until `want` nodes are alive, prints their records as JSON. Runs inside the namespace.
_NODES_PROBE = textwrap.dedent("""
    import json, socket, sys, time
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo
    address, want, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])
    nodes, error = [], None
    host, port = address.rsplit(":", 1)
    while True:
        try:
            # A GcsClient blocks for up to a minute when nothing listens: look first.
            socket.create_connection((host, int(port)), timeout=1).close()
            infos = GcsClient(address=address).get_all_node_info(timeout=2).values()
            nodes = [{"node_id": n.node_id.hex(), "ip": n.node_manager_address, "is_head": n.is_head_node,
                      "alive": n.state == GcsNodeInfo.GcsNodeState.ALIVE, "temp_dir": n.temp_dir} for n in infos]
            error = None
        except Exception as e:
            error = repr(e)
        if sum(n["alive"] for n in nodes) >= want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(json.dumps({"nodes": nodes, "error": error}))
""")


class RayClusterError(RuntimeError):
    """The cluster could not be started, or teardown left something behind."""


@dataclass
class Node:
    """One `ray start --block` process: its pid is its process group (own session)."""

    index: int
    proc: subprocess.Popen
    temp_dir: Path
    log: Path
    mount_ns: str = ""
    node_id: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class Teardown:
    """What `RayCluster.stop` did and found."""

    seconds: float = 0.0
    sigkilled: list[int] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)


def _proc_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _ns_inode(pid: int | str, kind: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}")
    except OSError:
        return ""


def pids_in_namespace(kind: str, inode: str) -> list[int]:
    """Live (non-zombie) pids whose `kind` namespace (net, mnt) is `inode` (as readlink shows it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _ns_inode(entry.name, kind) == inode:
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if stat[stat.rindex(")") + 2] != "Z":
                found.append(int(entry.name))
    return found


class RayCluster:
    """A head and `workers` worker nodes of Ray, all on 127.0.0.1 inside a private network namespace.

    Use as a context manager, or call `start()` and (always) `stop()`.
    """

    def __init__(self, base_dir: Path | str, workers: int = 1, num_cpus: int = 2, object_store_mb: int = 100,
                 port: int = RAY_PORT, ray_bin: str | None = None, env: dict[str, str] | None = None,
                 worker_private_dirs: tuple[Path, ...] = ()):
        self.base_dir = Path(base_dir)
        self.workers = workers
        self.num_cpus = num_cpus
        self.object_store_mb = object_store_mb
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self.ray_bin = ray_bin or str(Path(sys.executable).parent / "ray")
        self.python = sys.executable
        self.env = {**os.environ, **RAY_ENV, **(env or {})}
        # Directories that a worker node sees as its own empty tmpfs (say, a run's state directory).
        self.worker_private_dirs = [Path(d) for d in worker_private_dirs]
        self.netns = f"txflow-ray-{secrets.token_hex(4)}"
        self.net_inode = ""
        self.nodes: list[Node] = []
        self.started: list[subprocess.Popen] = []  # long-running commands started in the namespace
        self.start_seconds = 0.0
        self.teardown: Teardown | None = None
        self._stopped = False

    # -- lifecycle ---------------------------------------------------------------------------------------------

    def __enter__(self) -> RayCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        teardown = self.stop()
        if teardown.leftovers and exc[0] is None:
            raise RayClusterError(f"teardown left processes behind: {teardown.leftovers}")

    def start(self, timeout: float = 120.0) -> None:
        """Create the namespace, start the head and the worker nodes, return when all are alive in the GCS."""
        began = time.monotonic()
        deadline = began + timeout
        self.base_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ip", "netns", "add", self.netns], check=True, capture_output=True)
        self.net_inode = _ns_inode_of_netns(self.netns)
        subprocess.run(["ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up"], check=True,
                       capture_output=True)

        head_dir = self.base_dir / "head"
        head_dir.mkdir(exist_ok=True)
        # The dashboard is a head-only flag (a worker node given it refuses to start).
        self._start_node(0, head_dir, ["--head", "--port", str(self.port), "--include-dashboard=false"])
        # The head must accept registrations before a worker node can join: wait for it first.
        self._wait_alive(1, deadline)
        for i in range(1, self.workers + 1):
            node_dir = self.base_dir / f"node{i}"
            node_dir.mkdir(exist_ok=True)
            self._start_node(i, node_dir, ["--address", self.address], private_disk=True)
        alive = self._wait_alive(1 + self.workers, deadline)
        for node in self.nodes:
            match = [n for n in alive if n["temp_dir"] == str(node.temp_dir)]
            node.node_id = match[0]["node_id"] if match else ""
        self.start_seconds = time.monotonic() - began

    def _start_node(self, index: int, state_dir: Path, role_args: list[str], private_disk: bool = False) -> Node:
        temp_dir = state_dir / "ray"
        cmd = [self.ray_bin, "start", "--block", *role_args, "--node-ip-address", "127.0.0.1",
               "--disable-usage-stats", "--temp-dir", str(temp_dir),
               "--num-cpus", str(self.num_cpus), "--object-store-memory", str(self.object_store_mb * 1024 * 1024)]
        if private_disk:
            # Same shape as txflow's private_disk_command: `unshare` and `sh` exec, the pid stays ray's.
            mounts = "".join(f'mount -t tmpfs txflow-ray-node-disk "{d}" || exit 96; '
                             for d in self.worker_private_dirs)
            for directory in self.worker_private_dirs:
                directory.mkdir(parents=True, exist_ok=True)
            script = ('mount -t tmpfs txflow-ray-node-disk "$0" || exit 97; mkdir -p "$0/ray" || exit 98; '
                      + mounts + 'exec "$@"')
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(state_dir), *cmd]
        else:
            temp_dir.mkdir(exist_ok=True)
        log = self.base_dir / f"node{index}.out"
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *cmd], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)
        node = Node(index=index, proc=proc, temp_dir=temp_dir, log=log)
        self.nodes.append(node)
        return node

    def _wait_alive(self, want: int, deadline: float) -> list[dict]:
        """Block until `want` nodes are ALIVE in the GCS (polled inside the namespace), or raise with the logs."""
        while True:
            for node in self.nodes:
                if node.proc.poll() is not None:
                    raise RayClusterError(f"node {node.index} exited with {node.proc.returncode} during start-up:\n"
                                          f"{_tail(node.log)}")
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # The probe polls by itself; a short leash lets this loop see a node that died meanwhile.
            try:
                result = self.run([self.python, "-c", _NODES_PROBE, self.address, str(want), str(min(left, 10.0))],
                                  timeout=min(left, 10.0) + 20)
            except subprocess.TimeoutExpired:
                continue
            if result.returncode == 0:
                nodes = json.loads(result.stdout.strip().splitlines()[-1])["nodes"]
                alive = [n for n in nodes if n["alive"]]
                if len(alive) >= want:
                    for node in self.nodes:
                        if not node.mount_ns:
                            node.mount_ns = _ns_inode(node.pid, "mnt")
                    return alive
        logs = "\n".join(f"--- node {n.index} ({n.log}):\n{_tail(n.log)}" for n in self.nodes)
        raise RayClusterError(f"{want} Ray nodes were not alive before the deadline.\n{logs}")

    def nodes_info(self, timeout: float = 10.0) -> list[dict]:
        """Every node the GCS knows, alive or dead: node_id, ip, is_head, alive, temp_dir."""
        result = self.run([self.python, "-c", _NODES_PROBE, self.address, "0", "0"], timeout=timeout + 30, check=True)
        return json.loads(result.stdout.strip().splitlines()[-1])["nodes"]

    # -- running things inside -----------------------------------------------------------------------------------

    def command(self, cmd: list[str], node: int = 0) -> list[str]:
        """`cmd` as it must be run to execute inside the cluster's network namespace, seeing node `node`'s disk."""
        if node == 0:
            return ["ip", "netns", "exec", self.netns, *cmd]
        # A worker node's tmpfs exists only in its mount namespace: enter that and the network namespace.
        return ["nsenter", "--target", str(self.nodes[node].pid), "--mount", "--net", *cmd]

    def run(self, cmd: list[str], node: int = 0, timeout: float = 120.0, check: bool = False,
            env: dict[str, str] | None = None, input: str | None = None) -> subprocess.CompletedProcess:
        """Run `cmd` to completion inside the namespace; its text output and exit code come back."""
        result = subprocess.run(self.command(cmd, node), capture_output=True, text=True, timeout=timeout,
                                env={**self.env, **(env or {})}, input=input,
                                stdin=None if input else subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise RayClusterError(f"{cmd} exited {result.returncode}:\n{result.stdout[-3000:]}\n"
                                  f"{result.stderr[-3000:]}")
        return result

    def python_run(self, code: str, *args: str, **kw) -> subprocess.CompletedProcess:
        """Run a Python snippet inside the namespace with the test interpreter."""
        return self.run([self.python, "-c", code, *args], **kw)

    def spawn(self, cmd: list[str], log: Path, node: int = 0, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start a long-running `cmd` (a driver) inside the namespace, in its own session; `stop` kills it too."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(self.command(cmd, node), stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**self.env, **(env or {})},
                                    start_new_session=True)
        self.started.append(proc)
        return proc

    def listeners(self) -> list[tuple[str, str]]:
        """(local address:port, process) of every TCP listener in the namespace (`ss -ltnp`)."""
        out = self.run(["ss", "-Hltnp"], check=True).stdout
        rows = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 4:
                rows.append((parts[3], " ".join(parts[5:])))
        return rows

    def pids(self) -> list[int]:
        """Every live process in the cluster's network namespace: the cluster, its drivers, their children."""
        return pids_in_namespace("net", self.net_inode) if self.net_inode else []

    def inside(self) -> list[int]:
        """Every live process in the network namespace or in a node's own mount namespace. Teardown kills both: after
        a node's raylet is killed, a process can remain in that node's mount namespace once the network namespace is
        empty, and the leftover check would fail on it."""
        found = set(self.pids())
        ours = _ns_inode(str(os.getpid()), "mnt")  # never this process's own (a node's is always a private one)
        for node in self.nodes:
            if node.mount_ns and node.mount_ns != ours:
                found.update(pids_in_namespace("mnt", node.mount_ns))
        return sorted(found)

    def ray_processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of the cluster's raylet, gcs_server and `ray::` processes."""
        found = []
        for pid in self.pids():
            cmdline = _proc_cmdline(pid)
            if any(mark in cmdline for mark in ("raylet", "gcs_server", "ray::")):
                found.append((pid, cmdline))
        return found

    def kill_node(self, index: int, what: str = "raylet", sig: int = signal.SIGKILL) -> int:
        """Send `sig` to node `index`'s `what` process (raylet, gcs_server); returns its pid."""
        node = self.nodes[index]
        for pid in self.pids():
            if what in _proc_cmdline(pid).split(" ")[0] and _ns_inode(pid, "mnt") == node.mount_ns \
                    and _is_descendant(pid, node.pid):
                os.kill(pid, sig)
                return pid
        raise RayClusterError(f"no {what} process of node {index} found")

    # -- teardown -----------------------------------------------------------------------------------------------------

    def stop(self, grace_s: float = 2.0) -> Teardown:
        """Stop everything this cluster started, by pid; then check that nothing is left. Safe to call twice.

        `ray start --block` drains for up to 30 s on SIGTERM; a test cluster has nothing to drain, so the
        grace period is short and SIGKILL does the rest.
        """
        report = Teardown()
        if self._stopped:
            return report
        self._stopped = True
        began = time.monotonic()
        groups = [p.pid for p in self.started] + [n.pid for n in reversed(self.nodes)]
        for pgid in groups:
            _killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        # What outlived the grace period: the groups we started, then anything else still in the namespace.
        for pgid in groups:
            _killpg(pgid, signal.SIGKILL)
        for _ in range(50):
            left = self.inside()
            if not left:
                break
            for pid in left:
                report.sigkilled.append(pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for proc in [*self.started, *(n.proc for n in self.nodes)]:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                report.leftovers.append(f"pid {proc.pid} did not exit")
        report.leftovers += [f"pid {pid} in the network namespace: {_proc_cmdline(pid)}" for pid in self.pids()]
        for node in self.nodes:
            if node.mount_ns:
                report.leftovers += [f"pid {pid} in node {node.index}'s mount namespace"
                                     for pid in pids_in_namespace("mnt", node.mount_ns)]
        deleted = subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True, text=True)
        if deleted.returncode != 0 and Path(f"/run/netns/{self.netns}").exists():
            report.leftovers.append(f"network namespace {self.netns}: {deleted.stderr.strip()}")
        for node in self.nodes[1:]:
            if any(str(node.temp_dir.parent) in line for line in Path("/proc/self/mounts").read_text().splitlines()):
                report.leftovers.append(f"tmpfs of node {node.index} is mounted in this mount namespace")
        report.seconds = time.monotonic() - began
        self.teardown = report
        return report


def _ns_inode_of_netns(name: str) -> str:
    """The `net:[inode]` of a named network namespace, as /proc/<pid>/ns/net shows it."""
    inode = os.stat(f"/run/netns/{name}").st_ino
    return f"net:[{inode}]"


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _is_descendant(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
    return False


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@contextmanager
def running_cluster(**kwargs) -> Iterator[RayCluster]:
    """A started `RayCluster` under a fresh short base directory; stopped, checked and removed afterwards.

    Raises `RayClusterError` when teardown leaves anything behind. As a pytest fixture:

        @pytest.fixture
        def ray_cluster():
            with running_cluster(workers=1) as cluster:
                yield cluster
    """
    base = Path(f"/tmp/txr-{secrets.token_hex(3)}")  # short: Ray's unix socket paths must fit in 107 bytes
    cluster = RayCluster(base, **kwargs)
    try:
        cluster.start()
        yield cluster
    finally:
        report = cluster.stop()
        if report.leftovers:
            raise RayClusterError(f"Ray cluster teardown left: {report.leftovers} (logs kept in {base})")
        shutil.rmtree(base, ignore_errors=True)
