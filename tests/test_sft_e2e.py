"""`txflow run sft` end to end on a 2-process cluster, with a PostgreSQL database
whose password must never reach a log, a report or Prefect."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy

from tests.helpers import LOAD_PEFT_AND_GREEDY, PASSWORD_MARKER, alive_pids, new_prefect_home, run_txflow, until_eos
from txflow.checkpoints import export
from txflow.cluster.launchers import stop_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.together, pytest.mark.heavy(8)]



@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, postgres, prefect_db):
    """One real run shared by the assertions below (it is the expensive part)."""
    url = postgres("tinker_sft")
    work = tmp_path_factory.mktemp("sft")
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    env.update(PREFECT_HOME=str(new_prefect_home(work / "prefect-home", prefect_db)), DO_NOT_TRACK="1",
               TINKER_TELEMETRY="0")
    state = work / "state"
    try:
        result = run_txflow(["run", "sft", "--base-model", "tiny", "--run-id", "e2e-sft", "--state-dir", str(state),
                             "--checkpoints", str(work / "ckpt"), "--database-url", url, "--json"], env, work)
    finally:
        stop_cluster(state, grace_s=1.0)
    return {"result": result, "work": work, "state": state, "root": work / "ckpt" / "e2e-sft", "database_url": url}


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


def test_the_run_exports_a_peft_adapter_proven_against_skyrl_that_a_fresh_process_loads(sft_run):
    report = json.loads(sft_run["result"].stdout)
    block = report["export"]
    assert block["passed"] and block["greedy_tokens_match"]
    assert block["max_abs_logprob_diff"] <= block["logprob_bound"] == export.logprob_bound(block["float32_noise"])
    assert block["sampler_url"] == report["checkpoints"]["sampler"]["url"]
    peft = sft_run["root"] / "export" / "peft"
    assert block["peft_url"] == str(peft) and block["merged_url"] is None  # merged is opt-in
    config = json.loads((peft / "adapter_config.json").read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (32, 32, "CAUSAL_LM")
    assert "timings_s" in report and "export-adapter" in report["timings_s"]
    exports = [a for a in report["artifacts"] if a["kind"] == "export"]
    assert [(a["url"], a["complete"], a["committed"]) for a in exports] == [(str(peft), True, True)]
    # The run's reference figures are SkyRL's restored sampler on held-out sequences; a user's own process
    # loading the adapter with peft continues the reference prompts with the same greedy tokens.
    reference = json.loads((sft_run["root"] / "export-reference.json").read_text())
    assert reference["greedy_tokens"] == report["restore"]["restored_tokens"]
    loaded = subprocess.run([sys.executable, "-c", LOAD_PEFT_AND_GREEDY, reference["base_model"], str(peft),
                             json.dumps(reference["prompts"]), str(len(reference["greedy_tokens"][0]))],
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    greedy = json.loads(loaded.stdout)
    assert greedy["tokens"] == until_eos(reference["greedy_tokens"], greedy["eos"])


def test_the_readiness_sample_is_the_base_models_answers_and_is_not_asked_again(sft_run):
    """The readiness sample answers the held-out prompts with the base model, and the live reference takes those
    answers: the run asks the API for the held-out prompts' samples three times (the readiness's base model, the
    live model, the restored sampler), not four."""
    result = sft_run["result"]
    report = json.loads(result.stdout)
    prompts = len(report["restore"]["live_tokens"])
    assert 1 < prompts <= 32
    assert f"the base model's answers to {prompts} held-out prompts" in result.stderr
    # The API's access log wraps its lines: whitespace runs are one space.
    access = re.sub(r"\s+", " ", (sft_run["state"] / "logs" / "api.log").read_text())
    assert access.count("POST /api/v1/asample ") == 3 * prompts


def test_no_process_of_the_run_is_left(sft_run):
    assert alive_pids(sft_run["state"]) == []


def test_the_api_and_the_engine_woke_each_other(sft_run):
    # The `wake-channel` change: every training step's requests woke the engine, and its results the API.
    logs = sft_run["state"] / "logs"
    assert "the API's wakes reach the engine" in (logs / "rank0.log").read_text()
    assert "the engine's wakes reach the API" in (logs / "api.log").read_text()


def test_the_run_used_postgres(sft_run):
    # The URL was really used: SkyRL-tx's tables there hold this run's models.
    engine = sqlalchemy.create_engine(sft_run["database_url"])
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


def test_the_test_database_refuses_a_wrong_password_and_takes_the_right_one(postgres):
    """The proof above means something only if the database checks the password."""
    url = postgres("tinker_auth")
    good = sqlalchemy.create_engine(url)
    bad = sqlalchemy.create_engine(url.replace(PASSWORD_MARKER, "wrong-password"))
    try:
        with good.connect() as conn:
            assert conn.execute(sqlalchemy.text("SELECT 1")).scalar() == 1
        with pytest.raises(sqlalchemy.exc.OperationalError, match="password authentication failed"):
            bad.connect()
    finally:
        good.dispose()
        bad.dispose()
