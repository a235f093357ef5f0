"""provision-coordinator, launch-workers and teardown on a real 2-process SkyRL-tx cluster."""

from __future__ import annotations

import ipaddress
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tasks.launch_workers import launch_workers
from tasks.provision_coordinator import provision_coordinator
from tasks.teardown import teardown
from tests.helpers import alive_pids, cluster_pids, descendants, run_txflow, txflow_cmd
from txflow.cluster.launchers.local import LocalLauncher
from txflow.config import RunConfig
from txflow.processes.procfs import is_alive
from txflow.upstream.tiny_model import resolve_base_model

pytestmark = [pytest.mark.e2e, pytest.mark.heavy(9)]


def listening_addresses(port: int) -> set[str]:
    """Addresses listening on `port`, IPv4-mapped IPv6 (::ffff:a.b.c.d) shown as IPv4."""
    found = set()
    for conn in psutil.net_connections("all"):
        if conn.status == "LISTEN" and conn.laddr.port == port:
            ip = ipaddress.ip_address(conn.laddr.ip)
            found.add(str(getattr(ip, "ipv4_mapped", None) or ip))
    return found


def test_two_process_cluster_comes_up_proves_readiness_and_tears_down(tmp_path, reaper):
    cfg = RunConfig(base_model="tiny", processes=2, run_id="lifecycle", state_dir=str(tmp_path / "state"),
                    checkpoints=str(tmp_path / "ckpt")).resolved()
    reaper.watch(cfg.state_dir)
    launcher = LocalLauncher()

    handle = provision_coordinator.fn(cfg, launcher, resolve_base_model(cfg.base_model))
    cluster = handle.cluster
    recorded = json.loads((Path(cfg.state_dir) / "cluster.json").read_text())
    assert {p["role"] for p in recorded["processes"]} == {"api", "coordinator"}

    launch_workers.fn(cfg, handle)
    recorded = json.loads((Path(cfg.state_dir) / "cluster.json").read_text())
    by_role = {p["role"]: p for p in recorded["processes"]}
    assert set(by_role) == {"api", "coordinator", "worker"}
    assert (by_role["coordinator"]["rank"], by_role["worker"]["rank"]) == (0, 1)
    assert by_role["coordinator"]["ports"]["coordinator"] == cluster.coordinator_port
    for proc in recorded["processes"]:
        assert Path(proc["log"]).exists() and proc["host"] == "127.0.0.1"
    assert len(alive_pids(cfg.state_dir)) == 3
    # The readiness sample went through rank 1: it received the config and served the command.
    assert "entering command loop" in Path(by_role["worker"]["log"]).read_text()
    # The readiness sample's result reached the API by the engine's wake (the `wake-channel` change). (The
    # request was stored before the engine ran, so the engine found it by looking; the SFT e2e test
    # checks the other direction.)
    assert "the engine's wakes reach the API" in Path(by_role["api"]["log"]).read_text()
    # Every process of the cluster runs with 2 malloc arenas: a rank's heap would grow with the steps.
    for proc in recorded["processes"]:
        assert b"\0MALLOC_ARENA_MAX=2\0" in b"\0" + Path(f"/proc/{proc['pid']}/environ").read_bytes(), proc["role"]
    # Loopback only, for the API and the JAX coordinator.
    assert listening_addresses(cluster.api_port) == {"127.0.0.1"}
    assert listening_addresses(cluster.coordinator_port) == {"127.0.0.1"}
    assert "api_key" not in (Path(cfg.state_dir) / "cluster.json").read_text()
    # The readiness client's session heartbeats from a background thread until someone closes it.
    heartbeats = [c.holder._session_heartbeat_task for c in handle.clients]
    assert heartbeats and not any(h.done() for h in heartbeats)
    # The worker joined only once rank 0's coordinator listened (the `self-gated-startup` change), not by JAX's retries.
    assert f"coordinator {cluster.coordinator_address} accepts connections; joining" in \
        Path(by_role["worker"]["log"]).read_text()

    ranks = teardown.fn(handle, cfg.state_dir)
    assert alive_pids(cfg.state_dir) == []
    # Teardown stopped them: a long-lived process must not heartbeat a cluster that is gone.
    deadline = time.monotonic() + 5
    while not all(h.done() for h in heartbeats) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(h.cancelled() for h in heartbeats) and handle.clients == []
    assert [r["rank"] for r in ranks] == [None, 0, 1]
    # Every process stopped on SIGTERM, none needed the SIGKILL after the grace period: JAX's
    # preemption notifier would swallow SIGTERM in both ranks (the `default-sigterm` change).
    assert [r["exit_code"] for r in ranks] == [-signal.SIGTERM] * 3


class StuckWorkerLauncher(LocalLauncher):
    """Starts rank 1 as a process that never joins the JAX cluster."""

    def start(self, cluster, role, rank, cmd, env, ports, log_name, **secrets):
        if role == "worker":
            cmd = [sys.executable, "-c",
                   "print('worker stuck before joining', flush=True); import time; time.sleep(600)"]
        return super().start(cluster, role, rank, cmd, env, ports, log_name, **secrets)


def test_readiness_timeout_names_the_missing_rank_with_its_log(tmp_path, reaper):
    cfg = RunConfig(base_model="tiny", processes=2, run_id="stuck", state_dir=str(tmp_path / "state"),
                    checkpoints=str(tmp_path / "ckpt"), startup_timeout_s=25).resolved()
    reaper.watch(cfg.state_dir)
    launcher = StuckWorkerLauncher()
    handle = provision_coordinator.fn(cfg, launcher, resolve_base_model(cfg.base_model))
    try:
        with pytest.raises(TimeoutError) as failure:
            launch_workers.fn(cfg, handle)
    finally:
        teardown.fn(handle, cfg.state_dir)
    message = str(failure.value)
    assert "rank 1" in message and "worker stuck before joining" in message
    assert alive_pids(cfg.state_dir) == []


def _sft_args(tmp_path: Path, run_id: str, *extra: str) -> list[str]:
    return ["run", "sft", "--base-model", "tiny", "--run-id", run_id, "--state-dir", str(tmp_path / "state"),
            "--checkpoints", str(tmp_path / "ckpt"), "--no-export", *extra]  # these prove teardown


def test_every_process_is_stopped_after_an_exception(tmp_path, txflow_env, reaper):
    reaper.watch(tmp_path / "state")
    # A step deadline far below the first step's JIT compile makes training fail.
    result = run_txflow(_sft_args(tmp_path, "boom", "--steps", "3", "--step-timeout", "0.05",
                                  "--train-retries", "0", "--json"), txflow_env, tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["status"] == "failed" and "made no progress" in report["error"]
    assert len(cluster_pids(tmp_path / "state")) == 3
    assert alive_pids(tmp_path / "state") == []
    assert {r["rank"] for r in report["cluster"]["ranks"]} == {None, 0, 1}


def test_every_process_is_stopped_after_sigterm_to_the_flow_process(tmp_path, txflow_env, reaper):
    state = reaper.watch(tmp_path / "state")
    log = open(tmp_path / "txflow.log", "w")
    proc = subprocess.Popen(txflow_cmd(*_sft_args(tmp_path, "term", "--steps", "500")), env=txflow_env,
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        metrics = state / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, (tmp_path / "txflow.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(alive_pids(state)) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert "txflow: interrupted (SIGTERM)" in (tmp_path / "txflow.log").read_text()
    assert alive_pids(state) == []
    # Nothing the flow process started survives it (Prefect's temporary server included).
    assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []


def test_sigkill_of_txflow_leaves_nothing_it_started_alive_within_15_s(tmp_path, txflow_env, reaper):
    """What an OOM kill or a lost terminal does: no Python code of txflow runs. Every process it
    started (API, ranks, the embedded Prefect server) dies by itself: each notices its parent's
    death, or a rank dies first with its peer."""
    state = reaper.watch(tmp_path / "state")
    log = open(tmp_path / "txflow.log", "w")
    proc = subprocess.Popen(txflow_cmd(*_sft_args(tmp_path, "kill9", "--steps", "500")), env=txflow_env,
                            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        metrics = state / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, (tmp_path / "txflow.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        started = descendants(proc.pid)
        commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    for pid, _ in started}
        assert len(alive_pids(state)) == 3
        assert any("prefect.server.api.server:create_app" in c for c in commands.values()), commands
        proc.kill()
        killed_at = time.monotonic()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    left = started
    while left and time.monotonic() - killed_at < 15:
        time.sleep(0.2)
        left = [(pid, t) for pid, t in left if is_alive(pid, t)]
    assert left == [], {pid: commands.get(pid) for pid, _ in left}
    print(f"every descendant gone {time.monotonic() - killed_at:.1f} s after the SIGKILL")
    noticed = f"parent process {proc.pid} is gone"
    logs = {name: (state / "logs" / f"{name}.log").read_text() for name in ("api", "rank0", "rank1")}
    assert noticed in logs["api"], logs["api"][-3000:]
    # The ranks' lifelines fire together. The first rank to die can take its peer with it: JAX aborts a
    # rank whose coordination service (or whose peer's) connection closes, and that abort can win the
    # race against the peer's own lifeline thread (CI saw it once). So at least one rank must have
    # noticed by itself, and the other either noticed too or aborted on losing its peer.
    assert noticed in logs["rank0"] or noticed in logs["rank1"], {n: t[-2000:] for n, t in logs.items()}
    for name in ("rank0", "rank1"):
        assert noticed in logs[name] or "CoordinationService" in logs[name], logs[name][-3000:]
