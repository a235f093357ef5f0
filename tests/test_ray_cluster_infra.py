"""The two-node Ray test cluster (tests/ray_cluster.py) does what later Ray tests rely on.

Run under the machine's lock, as root: `flock <e2e lock> .venv/bin/python -m pytest -m e2e
tests/test_ray_cluster_infra.py -s` (`-s` shows the measured times).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.ray_cluster import RayCluster, pids_in_namespace
from txflow.processes.procfs import is_alive

pytestmark = [pytest.mark.e2e, pytest.mark.together]


@pytest.fixture(autouse=True)
def root_with_namespaces():
    # Failing, not skipping: without these the Ray tests would prove nothing, and say so only in a skip line.
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("nsenter"):
        pytest.fail("the Ray tests need root with ip and nsenter (network and mount namespaces)")

# A driver: connects, prints every node Ray knows as JSON.
DRIVER_NODES = textwrap.dedent("""
    import json, sys, ray
    ray.init(address=sys.argv[1], logging_level="ERROR")
    print(json.dumps([{"id": n["NodeID"], "alive": n["Alive"], "ip": n["NodeManagerAddress"]} for n in ray.nodes()]))
""")


@pytest.fixture
def base_dir():
    # Short on purpose: Ray's unix socket paths under it must fit in 107 bytes.
    path = Path(f"/tmp/txr-{secrets.token_hex(3)}")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "::ffff:127.0.0.1")


def test_two_nodes_come_up_on_loopback_only_and_teardown_leaves_nothing(base_dir):
    cluster = RayCluster(base_dir, workers=1, num_cpus=1, object_store_mb=100)
    try:
        cluster.start()
        print(f"\nstart-up: {cluster.start_seconds:.1f} s")

        # Both nodes alive in the GCS, as a driver inside the namespace sees them, with different ids.
        driver = cluster.python_run(DRIVER_NODES, cluster.address, timeout=120, check=True)
        nodes = json.loads(driver.stdout.strip().splitlines()[-1])
        assert len(nodes) == 2 and all(n["alive"] for n in nodes), nodes
        assert len({n["id"] for n in nodes}) == 2
        assert {n["ip"] for n in nodes} == {"127.0.0.1"}
        assert {n.node_id for n in cluster.nodes} == {n["id"] for n in nodes}

        # The worker node's state lives on its own tmpfs: it sees its session there, the host sees nothing.
        node1_dir = cluster.nodes[1].temp_dir
        inside = cluster.run(["ls", str(node1_dir)], node=1, check=True).stdout.split()
        assert any(name.startswith("session_") for name in inside), inside
        assert not node1_dir.exists() or not any(node1_dir.iterdir())

        # Every TCP listener in the namespace (GCS, raylets, agents, workers) is on 127.0.0.1.
        listeners = cluster.listeners()
        assert any(addr.endswith(f":{cluster.port}") for addr, _ in listeners), listeners
        assert [(a, p) for a, p in listeners if not _is_loopback(a)] == []

        ray_pids = [pid for pid, _ in cluster.ray_processes()]
        kinds = {cmd.split()[0].rsplit("/", 1)[-1] for _, cmd in cluster.ray_processes()}
        assert {"raylet", "gcs_server"} <= kinds
        mount_ns = cluster.nodes[1].mount_ns
    finally:
        teardown = cluster.stop()
    print(f"teardown: {teardown.seconds:.1f} s, SIGKILLed after the grace period: {len(teardown.sigkilled)}")

    assert teardown.leftovers == []
    assert not [pid for pid in ray_pids if is_alive(pid)]
    assert cluster.netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert pids_in_namespace("mnt", mount_ns) == []
    assert str(base_dir) not in Path("/proc/self/mounts").read_text()


def test_teardown_kills_what_escaped_the_process_groups(base_dir):
    """A driver's child in its own session is in no group teardown signals; it is in the namespace."""
    with RayCluster(base_dir, workers=1, num_cpus=1, object_store_mb=100) as cluster:
        pid_file = base_dir / "escaped.pid"
        script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '600'], start_new_session=True); "
                  f"open('{pid_file}', 'w').write(str(p.pid)); time.sleep(600)")
        cluster.spawn([sys.executable, "-c", script], base_dir / "driver.log")
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        escaped = int(pid_file.read_text())
        assert os.getpgid(escaped) == escaped
        teardown = cluster.stop()
    assert escaped in teardown.sigkilled
    assert not is_alive(escaped)
    assert teardown.leftovers == []
