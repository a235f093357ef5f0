"""The embedded Prefect server of `txflow run`: start-ups on one database take turns."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import descendants, listening_addresses, new_prefect_home
from txflow.cluster import embedded_prefect
from txflow.processes.procfs import is_alive


@pytest.fixture
def own_prefect_home(tmp_path, prefect_db, monkeypatch) -> Path:
    """A Prefect home of this test's own (a copy of the migrated template database), and no other
    PREFECT_ setting of the environment."""
    home = new_prefect_home(tmp_path / "prefect-home", prefect_db)
    for key in [k for k in os.environ if k.startswith("PREFECT_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PREFECT_HOME", str(home))
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return home


def test_a_second_start_waits_for_the_first_and_gives_up_at_the_limit(tmp_path):
    first = embedded_prefect.StartLock(tmp_path, timeout_s=1)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="Another Prefect server start held .* more than 0 s"):
        embedded_prefect.StartLock(tmp_path, timeout_s=0.3)
    assert time.monotonic() - started >= 0.3
    got = []
    waiter = threading.Thread(target=lambda: got.append(embedded_prefect.StartLock(tmp_path, timeout_s=10)))
    waiter.start()
    time.sleep(0.3)
    assert not got  # still waiting while the first holds it
    first.release()
    waiter.join(timeout=5)
    assert got
    got[0].release()


def test_a_server_that_cannot_be_spawned_leaves_the_start_lock_free(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))

    def no_spawn(*args, **kwargs):
        raise OSError("fork failed")

    monkeypatch.setattr(embedded_prefect.groups, "spawn", no_spawn)
    with pytest.raises(OSError, match="fork failed"):
        embedded_prefect.EmbeddedServer(tmp_path / "server.log")
    embedded_prefect.StartLock(tmp_path, timeout_s=0).release()  # free at once, not held by the failed start


@pytest.mark.e2e
def test_two_servers_starting_at_once_on_one_database_take_turns_and_both_come_up(tmp_path, own_prefect_home):
    # Without the start-up lock, one server's block-type registration can collide with the other's
    # (UNIQUE constraint failed: block_type.slug) and it exits: a `txflow run` failed that way in CI
    # (1 start in 3 here, with the lock removed). So the second server must not even be spawned before
    # the first answers.
    servers: list[embedded_prefect.EmbeddedServer] = []
    spawned, ready, errors = {}, {}, []

    def start(name: str) -> None:
        try:
            server = embedded_prefect.EmbeddedServer(tmp_path / f"{name}.log")
            spawned[name] = time.monotonic()
            servers.append(server)
            server.wait_ready()
            ready[name] = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(name,)) for name in ("one", "two")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert errors == [] and len(ready) == 2, errors
        for server in servers:  # each serves on the socket bound before it was spawned: no port to squat
            assert listening_addresses(server.port) == ["127.0.0.1"]
            [uvicorn] = [pid for pid, _ in descendants(server.proc.pid)]
            argv = Path(f"/proc/{uvicorn}/cmdline").read_bytes().split(b"\0")
            assert b"--fd" in argv and b"--port" not in argv
    finally:
        for server in servers:
            server.stop()
    first, second = sorted(ready, key=ready.get)
    assert spawned[second] >= ready[first], (spawned, ready)
    assert not any(is_alive(s.proc.pid) for s in servers)


@pytest.mark.e2e
def test_a_process_that_imported_prefect_first_still_uses_the_embedded_server(tmp_path, prefect_db):
    # Prefect reads PREFECT_API_URL at import; without the settings override, a flow run here would start
    # Prefect's own temporary server ("Starting temporary server" on stderr) instead of using ours.
    script = """
import sys
from prefect import flow
from txflow.cluster import embedded_prefect

@flow
def hello():
    from prefect.settings import PREFECT_API_URL
    return PREFECT_API_URL.value()

with embedded_prefect.server(sys.argv[1]) as server:
    server.wait_ready()
    used = hello()
    print("USED", used, "OURS", server.api_url)
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(new_prefect_home(tmp_path / "prefect-home", prefect_db)),
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    used, ours = result.stdout.split("USED ")[1].split(" OURS ")
    assert used.strip() == ours.strip()
    assert "Starting temporary server" not in result.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("given, enabled", [(None, False), ("true", True)])
def test_automations_are_off_in_the_embedded_server_unless_asked_for(tmp_path, own_prefect_home, monkeypatch, given,
                                                                     enabled):
    # The trigger services cost CPU the ranks need; a server that lives for one run has no use for them.
    import httpx

    if given is not None:
        monkeypatch.setenv("PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED", given)
    server = embedded_prefect.EmbeddedServer(tmp_path / "server.log")
    try:
        server.wait_ready()
        settings = httpx.get(f"{server.api_url}/admin/settings", timeout=10).json()  # the server's own view
        listening = listening_addresses(server.port)
    finally:
        server.stop()
    assert settings["server"]["services"]["triggers"]["enabled"] is enabled
    assert listening == ["127.0.0.1"]  # loopback only (docs/security.md)
    assert not is_alive(server.proc.pid)


@pytest.mark.e2e
def test_the_last_log_line_reaches_a_named_server_before_the_process_leaves(tmp_path, own_prefect_home):
    # `txflow` exits without Prefect's exit handlers (cli.entry), so the server context must deliver what
    # Prefect's log worker still holds, also when PREFECT_API_URL names the server (here a real one that
    # the test starts, standing for a user's `prefect server`).
    import httpx

    script = """
import os, sys
from prefect import flow, get_run_logger
from txflow.cluster import embedded_prefect

@flow
def hello():
    get_run_logger().info("the last line of the run")

with embedded_prefect.server(sys.argv[1]):
    hello()
os._exit(0)  # as cli.entry leaves
"""
    server = embedded_prefect.EmbeddedServer(tmp_path / "server.log")
    try:
        server.wait_ready()
        result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                                env={**os.environ, "PREFECT_API_URL": server.api_url}, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        logs = httpx.post(f"{server.api_url}/logs/filter", json={"limit": 200}, timeout=30).json()
    finally:
        server.stop()
    assert "the last line of the run" in [entry["message"] for entry in logs], result.stderr[-3000:]


@pytest.mark.parametrize(("preset", "expected"), [(None, 120.0), ("", 120.0), ("45", 45.0)])
def test_the_embedded_prefect_server_gets_120_s_to_start_unless_told(monkeypatch, preset, expected):
    # Prefect's 20 s default failed a run on a busy machine while the server migrated its new database.
    monkeypatch.delenv(embedded_prefect.STARTUP_TIMEOUT_ENV, raising=False)
    if preset is not None:
        monkeypatch.setenv(embedded_prefect.STARTUP_TIMEOUT_ENV, preset)
    assert embedded_prefect.startup_timeout_s() == expected
