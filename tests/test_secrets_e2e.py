"""No credential reaches an output on a failure path: a wrong database password, a store that does not
answer with a secret storage option, and a flow run (Prefect's own records) that fails on a dataset URL
holding credentials. The happy paths are searched in test_sft_e2e.py and test_s3_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import PASSWORD_MARKER, new_prefect_home, run_txflow
from txflow.processes.ports import free_port

pytestmark = pytest.mark.e2e

MARKER = "cred-MARKER-5b27e0"


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    return lines[0]


def test_a_wrong_database_password_is_refused_before_anything_starts(tmp_path, txflow_env, postgres):
    url = postgres("tinker_wrong").replace(PASSWORD_MARKER, MARKER)
    result = run_txflow(["run", "sft", "--base-model", "tiny", "--run-id", "pw", "--state-dir", str(tmp_path / "state"),
                         "--checkpoints", str(tmp_path / "ckpt"), "--database-url", url], txflow_env, tmp_path, 120)
    line = one_line(result)
    assert line.startswith("txflow: --database-url postgresql://txflow:***@/tinker_wrong") and "password" in line
    assert MARKER not in result.stderr + result.stdout
    assert not (tmp_path / "state" / "cluster.json").exists()


def test_a_store_that_does_not_answer_never_shows_the_storage_option(tmp_path, txflow_env):
    result = run_txflow(["run", "sft", "--base-model", "tiny", "--run-id", "so", "--state-dir", str(tmp_path / "state"),
                         "--checkpoints", "s3://bucket/runs", "--storage-option", "key=txflow-test",
                         "--storage-option", f"secret={MARKER}",
                         "--storage-option", f"endpoint_url=http://127.0.0.1:{free_port()}"], txflow_env, tmp_path, 300)
    assert "--checkpoints s3://bucket/runs: cannot write under s3://bucket/runs/so" in one_line(result)
    assert MARKER not in result.stderr + result.stdout


FLOW = """
import sys
from txflow.cluster import embedded_prefect
from txflow.config import RunConfig

cfg = RunConfig(mode="sft", base_model="tiny", run_id="leaky", database_url=sys.argv[1], state_dir=sys.argv[2],
                checkpoints=sys.argv[3], storage_options={"secret": sys.argv[4]})
with embedded_prefect.server(sys.argv[2]) as server:
    from flows.train import train_flow
    server.wait_ready()
    try:
        train_flow(config=cfg.resolved())
    except Exception as exc:
        print("flow failed:", type(exc).__name__)
"""


def test_a_flow_run_that_fails_keeps_its_credentials_out_of_prefect(tmp_path, prefect_db):
    """Deployment runs run pre-flight inside the flow: Prefect records the run (its parameters), the failure
    (its state message, its logs, the traceback it logs itself), and none of it may hold a database password
    or a storage option. The database is one nothing listens on."""
    home = new_prefect_home(tmp_path / "prefect-home", prefect_db)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    url = f"postgresql://user:{MARKER}@127.0.0.1:{free_port()}/db"
    result = subprocess.run([sys.executable, "-c", FLOW, url, str(tmp_path / "state"), str(tmp_path / "ckpt"),
                             "storage-" + MARKER], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "flow failed: PreflightError" in result.stdout, result.stderr[-3000:]
    assert MARKER not in result.stdout + result.stderr
    time.sleep(1)  # the server has stopped; its database files are complete
    stored = b"".join(p.read_bytes() for p in Path(home).rglob("*") if p.is_file())
    assert b"postgresql://user:***@127.0.0.1" in stored  # the failure reached Prefect: the search below means something
    assert MARKER.encode() not in stored
