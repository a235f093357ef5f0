"""The restore check can fail: a run whose saved state is not the live model's ends failed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import alive_pids

pytestmark = [pytest.mark.e2e, pytest.mark.heavy(10)]

# The real flow, with save-checkpoint handing evaluate-restore the state of step 1 as if it were the
# final one: what a mix-up of checkpoints (or a save that kept an old file) would look like.
WRONG_STATE = textwrap.dedent("""
    import json, sys
    from txflow.cluster import embedded_prefect
    from txflow.checkpoints import storage
    from txflow.training import saving as step

    real = step.save_model_checkpoints

    def with_the_state_of_step_1(cfg, handle, trained):
        saved = real(cfg, handle, trained)
        first = min((a for a in storage.discover(cfg.run_root) if a.kind == "state"),
                    key=lambda a: storage.step_of(a.path))
        saved.checkpoints[0] = saved.checkpoints[0].model_copy(update={"url": first.url})
        return saved

    step.save_model_checkpoints = with_the_state_of_step_1
    from flows.train import RunFailed, train_flow
    from txflow.config import RunConfig

    cfg = RunConfig.model_validate(json.loads(sys.argv[1])).resolved()
    with embedded_prefect.server(cfg.state_dir) as server:
        server.wait_ready()
        try:
            train_flow(config=cfg)
            report = None
        except RunFailed as failed:
            report = failed.report.model_dump(mode="json")
    print(json.dumps(report))
""")


def test_a_wrong_checkpoint_fails_the_restore_check_and_the_run(tmp_path, txflow_env, reaper):
    state = reaper.watch(tmp_path / "state")
    config = {"mode": "sft", "base_model": "tiny", "processes": 1, "steps": 4, "save_every": 1, "run_id": "wrong",
              "state_dir": str(state), "checkpoints": str(tmp_path / "ckpt")}
    result = subprocess.run([sys.executable, "-c", WRONG_STATE, json.dumps(config)], env=txflow_env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report is not None, "the run passed with the state of step 1 as its final state"
    assert report["status"] == "failed"
    restore = report["restore"]
    assert restore["passed"] is False and restore["abs_diff"] > 1e-6
    assert restore["sampler_tokens_match"] and restore["tokens_differ_from_base"]  # only the state was wrong
    assert alive_pids(state) == []

