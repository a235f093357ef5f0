"""`txflow run rl` and `txflow run custom` end to end, on one JAX process each: what is under test here
(learning, exact restore, a custom client's retry) does not depend on the number of ranks, which
test_sft_e2e, test_fault_e2e and test_ray_e2e prove with two."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import alive_pids, run_txflow

pytestmark = [pytest.mark.e2e, pytest.mark.heavy(5)]

CLIENT = Path(__file__).parent / "clients" / "sft_client.py"


def test_rl_run_improves_reward_and_restores_exactly(tmp_path, txflow_env, reaper):
    state = reaper.watch(tmp_path / "state")
    result = run_txflow(["run", "rl", "--base-model", "tiny", "--run-id", "e2e-rl", "--state-dir", str(state),
                         "--processes", "1",
                         "--checkpoints", str(tmp_path / "ckpt"), "--json"], txflow_env, tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout)
    assert report["status"] == "passed" and report["mode"] == "rl"
    metrics = report["metrics"]
    assert len(metrics) == 20
    assert {"reward_mean", "reward_std", "tokens_sampled", "seconds"} <= set(metrics[0])
    restore = report["restore"]
    assert restore["reward_last_quarter"] > restore["reward_first_quarter"]
    assert restore["abs_diff"] <= 1e-6 and restore["sampler_tokens_match"]
    assert restore["eval_reward"] > restore["base_eval_reward"]
    kinds = {(a["kind"], a["format"], a["complete"]) for a in report["artifacts"]}
    assert {("state", "directory", True), ("sampler", "tarball", True)} <= kinds
    # Sampling clients' transient weights do not stay in the durable root.
    assert not [a for a in report["artifacts"] if "/sampler_weights/ss" in a["url"]]
    # Two forward passes in all: the live model's loss on its rollouts and the restored state's. (RL's bar
    # compares rewards: the base model's loss, which SFT's bar needs, is not computed.)
    assert forward_passes(state / "logs" / "rank0.log") == 2
    assert alive_pids(state) == []


def forward_passes(rank_log) -> int:
    """The forward requests rank 0's engine processed, from its timing lines (wrapped in the log)."""
    text = " ".join(rank_log.read_text().split())
    return sum(int(n) for n in re.findall(r"process_batch_requests\(forward, n=(\d+)\)", text))


def test_ppo_with_substeps_clips_and_so_differs_from_importance_sampling(tmp_path, txflow_env, reaper):
    """The same short run twice, 4 substeps each, PPO and importance sampling: the first rollouts are the
    same (same seed, same weights), PPO clips some tokens, and the two end with different weights. (With
    one substep, or a clip that never acts, PPO's update is importance sampling's to every digit.)"""
    reports = {}
    for loss in ("ppo", "importance_sampling"):
        state = reaper.watch(tmp_path / loss)
        result = run_txflow(["run", "rl", "--base-model", "tiny", "--run-id", f"e2e-{loss}", "--state-dir", str(state),
                             "--loss", loss,
                             "--substeps", "4", "--steps", "2", "--processes", "1", "--save-every", "0",
                             "--checkpoints", str(tmp_path / "ckpt"), "--json"], txflow_env, tmp_path, timeout=600)
        # Two steps are too few for the quality bar; the run may fail it, but it trains, saves and restores.
        assert result.returncode in (0, 1) and result.stdout, result.stderr[-4000:]
        reports[loss] = json.loads(result.stdout)
        assert reports[loss]["restore"]["abs_diff"] <= 1e-6, reports[loss]["restore"]
        assert alive_pids(state) == []
    ppo, importance = reports["ppo"], reports["importance_sampling"]
    assert ppo["metrics"][0]["reward_mean"] == importance["metrics"][0]["reward_mean"]
    assert max(m["clip_fraction"] for m in ppo["metrics"]) > 0, ppo["metrics"]
    assert "clip_fraction" not in importance["metrics"][0]
    assert abs(ppo["restore"]["loss_before"] - importance["restore"]["loss_before"]) > 1e-4


def test_custom_client_runs_again_after_a_fault_and_every_checkpoint_it_saved_is_verified(tmp_path, txflow_env,
                                                                                          reaper):
    """A rank dies while the user's client trains: the client is the only one that knows how to go
    on, so it runs again from the start on a fresh cluster, and the report says so."""
    import os
    import signal
    import subprocess
    import time

    from tests.helpers import txflow_cmd

    state = reaper.watch(tmp_path / "state")
    out, err = open(tmp_path / "out.json", "w"), open(tmp_path / "err.log", "w")
    proc = subprocess.Popen(txflow_cmd("run", "custom", "--base-model", "tiny", "--run-id", "e2e-custom",
                                       "--state-dir", str(state),
                                       "--checkpoints", str(tmp_path / "ckpt"), "--client", str(CLIENT),
                                       "--train-retries", "1", "--processes", "1",
                                       "--client-arg=--base-url", "--client-arg={base_url}",
                                       "--client-arg=--model-name", "--client-arg={base_model}",
                                       "--client-arg=--steps", "--client-arg=12", "--client-arg=--early-save",
                                       "--json"),
                            env=txflow_env, cwd=tmp_path, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 400
        client_log = state / "logs" / "client.log"
        # The client has saved a checkpoint on this cluster when the rank dies: its retry starts from scratch.
        while not (client_log.exists() and "step 1 loss" in client_log.read_text()
                   and "saved early state" in client_log.read_text()):
            assert proc.poll() is None, (tmp_path / "err.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the client did not start training"
            time.sleep(0.2)
        rank = next(p for p in json.loads((state / "cluster.json").read_text())["processes"] if p["rank"] == 0)
        os.kill(rank["pid"], signal.SIGKILL)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
        err.close()
    stderr = (tmp_path / "err.log").read_text()
    assert code == 0, stderr[-4000:]
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["status"] == "passed" and report["mode"] == "custom"
    assert report["client_runs"] == 2
    [failure] = report["failures"]
    assert (failure["rank"], failure["step"], failure["resumed_at"]) == (0, "train", "train")
    assert "re-running the custom client from the start (run 2)" in stderr
    # The client's output streamed into the run's logs.
    client_log = (state / "logs" / "client.log").read_text()
    assert "saved state tinker://" in client_log and "client: saved sampler" in stderr
    # Only what the second run of the client saved is committed: its three checkpoints, all of its model,
    # none of the first run's (its early state was left in staging by the attempt that died).
    early = re.findall(r"saved early state tinker://(\w+)/", client_log)
    assert len(early) == 2 and early[0] != early[1]
    committed = sorted(c["tinker_path"] for c in report["checkpoints"]["all"])
    second = early[1]
    assert committed == sorted([f"tinker://{second}/weights/client-early", f"tinker://{second}/weights/client-state",
                                f"tinker://{second}/sampler_weights/client-sampler"]), committed
    assert not list((tmp_path / "ckpt" / "e2e-custom").glob(f"{early[0]}*"))
    checks = {c["tinker_path"]: c for c in report["restore"]["checks"]}
    assert all(c["passed"] for c in checks.values()) and report["restore"]["passed"]
    artifacts = {a["url"]: a for a in report["artifacts"]}
    formats = {c["kind"]: artifacts[c["url"]]["format"] for c in report["checkpoints"]["all"]}
    assert formats == {"state": "directory", "sampler": "tarball"}
    assert all(artifacts[c["url"]]["complete"] and artifacts[c["url"]]["committed"]
               for c in report["checkpoints"]["all"])
    assert alive_pids(state) == []


def test_custom_client_that_fails_fails_the_run_with_its_output(tmp_path, txflow_env, reaper):
    state = reaper.watch(tmp_path / "state")
    bad = tmp_path / "bad_client.py"
    # It dies of a signal, as a native library or an SDK's daemon thread at interpreter exit can, with a
    # second thread alive: the run's error names the signal, and the client's log holds both threads' stacks.
    bad.write_text("import os, threading, time\n"
                   "def background_loop():\n    time.sleep(600)\n"
                   "threading.Thread(target=background_loop, daemon=True).start()\n"
                   "print('about to fail', flush=True)\nos.abort()\n")
    result = run_txflow(["run", "custom", "--base-model", "tiny", "--run-id", "bad-custom", "--state-dir", str(state),
                         "--processes", "1",
                         "--checkpoints", str(tmp_path / "ckpt"), "--client", str(bad), "--json"],
                        txflow_env, tmp_path)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert "exited with code -6" in report["error"] and "about to fail" in report["error"], report["error"]
    log = (state / "logs" / "client.log").read_text()
    assert "Fatal Python error: Aborted" in log and 'in background_loop' in log, log
    assert alive_pids(state) == []
