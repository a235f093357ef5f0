"""Only the run's own clients get in, and the run's files are its owner's (docs/security.md).

One real custom run on the default cluster: its client probes the Tinker API without the key, with a
wrong one and with the run's (tests/clients/auth_probe.py). Then every file and folder the run created
is walked for group or other permission bits, and every output for the key.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.helpers import API_KEY_MARKER, alive_pids, run_txflow

pytestmark = [pytest.mark.e2e, pytest.mark.together, pytest.mark.heavy(11)]

PROBE = Path(__file__).parent / "clients" / "auth_probe.py"


@pytest.fixture(scope="module")
def probed(tmp_path_factory, prefect_db):
    from tests.helpers import new_prefect_home
    from txflow.cluster.launchers import stop_cluster

    work = tmp_path_factory.mktemp("security")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(new_prefect_home(work / "prefect-home", prefect_db)), DO_NOT_TRACK="1",
               TINKER_TELEMETRY="0", TINKER_API_KEY=API_KEY_MARKER)
    state = work / "state"
    # The usual umask, whatever the caller's (CI may run with 077): the run must make its files private
    # itself. The run inherits it; the control file shows the test is not vacuous.
    previous = os.umask(0o022)
    try:
        (work / "control.txt").write_text("x")
        result = run_txflow(["run", "custom", "--base-model", "tiny", "--run-id", "probe", "--state-dir", str(state),
                             "--checkpoints", str(work / "new-root"), "--client", str(PROBE),
                             "--client-arg={base_model}", f"--client-arg={state}", "--processes", "1", "--json"],
                            env, work)
    finally:
        os.umask(previous)
        stop_cluster(state, grace_s=1.0)
    return {"result": result, "work": work, "state": state}


def probe_results(probed) -> dict:
    log = (probed["state"] / "logs" / "client.log").read_text()
    return json.loads(next(line for line in log.splitlines() if line.startswith("{")))


def test_the_run_passes_with_its_own_client(probed):
    result = probed["result"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["status"] == "passed"
    assert alive_pids(probed["state"]) == []


def test_requests_without_the_runs_key_are_refused_on_every_route_but_the_health_check(probed):
    found = probe_results(probed)
    assert found["healthz"] == 200
    # The one other exception: the download URL get_checkpoint_archive_url signed, as it was handed out.
    assert found["signed download, no key"] == 200
    assert (found["tampered download, no key"], found["unsigned download, no key"]) == (403, 401)
    for route in ("create_session", "training_runs", "save_weights_for_sampler"):
        assert found[f"{route}, no key"] == 401, route
        assert found[f"{route}, wrong key"] == 401, route
    for route in ("create_session", "training_runs"):
        assert found[f"{route}, the run's key"] == 200 and found[f"{route}, bearer"] == 200, route
    assert found["sdk, wrong key"] == "AuthenticationError"
    assert found["sdk, the run's key"].startswith("tinker://")
    # One line that says what to do, and never the key.
    refusal = json.loads(found["refusal"])["detail"]
    assert "X-API-Key" in refusal and "\n" not in refusal and API_KEY_MARKER not in found["refusal"]


def test_the_key_reaches_no_file_no_command_line_and_no_output(probed):
    result = probed["result"]
    assert API_KEY_MARKER not in result.stdout and API_KEY_MARKER not in result.stderr
    leaks = [str(p) for top in (probed["state"], probed["work"] / "new-root") for p in Path(top).rglob("*")
             if p.is_file() and API_KEY_MARKER.encode() in p.read_bytes()]
    assert leaks == []
    cluster = json.loads((probed["state"] / "cluster.json").read_text())
    assert "api_key" not in cluster and cluster["processes"]  # it was written, without the key


def test_every_file_and_folder_the_run_created_is_its_owners_alone(probed):
    created = [probed["state"], probed["work"] / "new-root"]
    paths = [p for top in created for p in [top, *top.rglob("*")]]
    names = {p.name for p in paths}
    # The logs, cluster.json, staging and committed checkpoints, after the run.
    assert {"tinker.db", "rank0.log", "api.log", "cluster.json", "manifest.json", "report.json"} <= names, \
        sorted(names)
    assert any(p.suffix == ".gz" and "checkpoints" in p.parts for p in paths)  # staging
    opened = [(str(p), oct(stat.S_IMODE(p.lstat().st_mode))) for p in paths
              if not p.is_symlink() and stat.S_IMODE(p.lstat().st_mode) & 0o077]
    assert opened == []
    # While the cluster ran (the client looked): the database with its WAL and SHM files, which SQLite
    # removes at a clean close.
    live = probe_results(probed)["live modes"]
    assert {"tinker.db", "tinker.db-wal", "tinker.db-shm", "cluster.json"} <= {Path(p).name for p in live}, live
    assert {p: mode for p, mode in live.items() if int(mode, 8) & 0o077} == {}
    # Not vacuous: what the launching process created under the same umask is readable by others.
    assert stat.S_IMODE((probed["work"] / "control.txt").stat().st_mode) & 0o044
