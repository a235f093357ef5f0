"""`txflow run sft` on a real model, SmolLM2-135M-Instruct in bfloat16, with every default: the model's learning
rate, its chat template, the export and its proof. One process, 4 steps; ~6-8 minutes on this machine."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_txflow

pytestmark = [pytest.mark.e2e, pytest.mark.heavy(0)]


def test_a_real_bf16_model_learns_and_its_export_is_proven(tmp_path, txflow_env, reaper):
    state = reaper.watch(tmp_path / "state")
    result = run_txflow(["run", "sft", "--base-model", "smollm2-135m", "--processes", "1", "--steps", "4",
                         "--run-id", "real", "--state-dir", str(state), "--checkpoints", str(tmp_path / "ckpt"),
                         "--json"], txflow_env, tmp_path, timeout=1500)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "learning rate 0.00132 (the cookbook's LoRA rule for a llama model of hidden size 576)" in result.stderr
    report = json.loads(result.stdout)
    assert report["status"] == "passed" and report["learning_rate"] == pytest.approx(1.32e-3)
    restore = report["restore"]
    assert restore["eval_loss_gain"] > 1.0 and restore["passed"]  # measured: +5.08 nats in 6 steps
    block = report["export"]
    assert block["passed"] and block["greedy_tokens_match"]
    assert block["max_abs_logprob_diff"] <= block["logprob_bound"]
    assert block["compared_against"].startswith("SkyRL-tx's forward of the checkpoint in float32 (the cluster "
                                                "computed in bfloat16)")
    assert block["cluster_mean_abs_logprob_diff"] < 0.5  # bfloat16's noise, reported (measured 0.13)
    print(f"real model: losses {[round(m['nll'], 3) for m in report['metrics']]}, gain "
          f"{restore['eval_loss_gain']:.2f}, export {block['max_abs_logprob_diff']:.2e} / cluster "
          f"{block['cluster_max_abs_logprob_diff']:.3f} max, {block['cluster_mean_abs_logprob_diff']:.3f} mean, "
          f"timings {report['timings_s']}")
