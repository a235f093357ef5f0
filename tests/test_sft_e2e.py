"""`txflow run sft` end to end on a 2-process cluster, with a PostgreSQL database
whose password must never reach a log, a report or Prefect."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pgserver
import sqlalchemy
import pytest

from tests.helpers import alive_pids, run_txflow
from txflow.cluster import stop_cluster

pytestmark = pytest.mark.e2e

PASSWORD_MARKER = "pw-MARKER-7f3c91"


@pytest.fixture(scope="module")
def postgres_url(tmp_path_factory):
    """A real PostgreSQL (unix socket only, no TCP) with a user whose password is the marker."""
    # Not under pytest's 0700 temp root: the server runs as its own system user.
    data_dir = Path(tempfile.mkdtemp(prefix="txflow-pg-"))
    server = pgserver.get_server(data_dir, cleanup_mode="stop")
    try:
        server.psql(f"CREATE USER txflow WITH PASSWORD '{PASSWORD_MARKER}'; CREATE DATABASE tinker OWNER txflow;")
        yield f"postgresql://txflow:{PASSWORD_MARKER}@/tinker?host={data_dir}", server
    finally:
        server.cleanup()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, postgres_url):
    """One real run shared by the assertions below (it is the expensive part)."""
    url, server = postgres_url
    work = tmp_path_factory.mktemp("sft")
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    env.update(PREFECT_HOME=str(work / "prefect-home"), DO_NOT_TRACK="1", TINKER_TELEMETRY="0")
    state = work / "state"
    try:
        result = run_txflow(["run", "sft", "--run-id", "e2e-sft", "--state-dir", str(state),
                             "--checkpoints", str(work / "ckpt"), "--database-url", url, "--json"], env, work)
    finally:
        stop_cluster(state, grace_s=1.0)
    return {"result": result, "work": work, "state": state, "root": work / "ckpt" / "e2e-sft", "server": server}


def test_sft_run_passes_and_reports(sft_run):
    result = sft_run["result"]
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report == json.loads((sft_run["root"] / "report.json").read_text())
    assert report["status"] == "passed" and report["mode"] == "sft" and report["num_processes"] == 2
    metrics = report["metrics"]
    assert [m["step"] for m in metrics] == list(range(1, 21))
    assert metrics[-1]["nll"] < metrics[0]["nll"]
    restore = report["restore"]
    assert restore["abs_diff"] <= 1e-6 and restore["sampler_tokens_match"] and restore["passed"]
    assert restore["restored_tokens"] == restore["live_tokens"]
    artifacts = {a["url"]: a for a in report["artifacts"]}
    state = artifacts[report["checkpoints"]["state"]["url"]]
    sampler = artifacts[report["checkpoints"]["sampler"]["url"]]
    assert (state["kind"], state["format"], state["complete"]) == ("state", "directory", True)
    assert state["url"].endswith(".tar.gz") and Path(state["url"]).is_dir()
    assert (sampler["kind"], sampler["format"], sampler["complete"]) == ("sampler", "tarball", True)
    assert state["committed"] and sampler["committed"]
    manifest = json.loads((sft_run["root"] / "manifest.json").read_text())
    assert {a["url"] for a in manifest["artifacts"]} == set(artifacts)
    lines = (sft_run["root"] / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == metrics
    assert set(report["timings_s"]) >= {"provision-coordinator", "launch-workers", "train", "save-checkpoint",
                                         "discover-artifacts", "evaluate-restore", "teardown", "total"}
    assert {r["rank"] for r in report["cluster"]["ranks"]} == {None, 0, 1}


def test_no_process_of_the_run_is_left(sft_run):
    assert alive_pids(sft_run["state"]) == []


def test_the_run_used_postgres(sft_run, postgres_url):
    # The URL was really used: SkyRL-tx's tables there hold this run's models.
    engine = sqlalchemy.create_engine(postgres_url[0])
    try:
        with engine.connect() as conn:
            assert conn.execute(sqlalchemy.text("SELECT count(*) FROM models")).scalar() >= 2
    finally:
        engine.dispose()


def test_database_password_is_in_no_log_report_or_prefect_store(sft_run):
    result = sft_run["result"]
    assert PASSWORD_MARKER not in result.stdout and PASSWORD_MARKER not in result.stderr
    leaks = []
    for top in (sft_run["state"], sft_run["root"], sft_run["work"] / "prefect-home"):
        for path in Path(top).rglob("*"):
            if path.is_file() and PASSWORD_MARKER.encode() in path.read_bytes():
                leaks.append(str(path))
    assert leaks == []
    # Logs exist and are not empty: the check above looked at real output.
    assert (sft_run["state"] / "logs" / "rank0.log").stat().st_size > 0
    assert list((sft_run["work"] / "prefect-home").rglob("*.db"))
