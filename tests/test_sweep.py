"""A sweep's grid, its ranking and its refusals, without a cluster. The sweep on a real
cluster, with a failed member and the promotion of the best, is in tests/test_shared_cluster_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_cli import cli_exit
from txflow.artifacts import promote
from txflow.config import RunConfig
from txflow.reporting import sweep
from txflow.reporting.report import RunReport


def grid(tmp_path, rates, ranks, **fields):
    config = RunConfig(base_model="tiny", checkpoints=str(tmp_path / "ckpt"), **fields)
    return sweep.grid(config, "sw", rates, ranks, "shared", tmp_path / "state")


def test_the_grid_is_every_pair_of_rate_and_rank_each_a_run_of_its_own_attached_to_the_cluster(tmp_path):
    members = grid(tmp_path, [1e-3, 1e-2], [8, 16, 32], steps=5)
    assert [(m.run_id, m.learning_rate, m.lora_rank) for m in members] == [
        ("sw-00", 1e-3, 8), ("sw-01", 1e-3, 16), ("sw-02", 1e-3, 32),
        ("sw-03", 1e-2, 8), ("sw-04", 1e-2, 16), ("sw-05", 1e-2, 32)]
    assert {m.cluster for m in members} == {"shared"} and {m.steps for m in members} == {5}
    assert [m.state_dir for m in members] == [str(tmp_path / "state" / f"sw-0{i}") for i in range(6)]
    assert len({m.run_root for m in members}) == 6


def test_a_grid_of_one_axis_keeps_the_configs_other_value(tmp_path):
    members = grid(tmp_path, [], [8, 16], learning_rate=3e-3)
    assert [(m.learning_rate, m.lora_rank) for m in members] == [(3e-3, 8), (3e-3, 16)]
    members = grid(tmp_path, [1e-3, 1e-2], [])
    assert [(m.learning_rate, m.lora_rank) for m in members] == [(1e-3, 32), (1e-2, 32)]


@pytest.mark.parametrize(("rates", "ranks", "message"), [
    ([1e-3], [], "at least two points"),
    ([], [], "at least two points"),
    ([1e-3, 1e-3], [], "--learning-rate lists 0.001 more than once"),
    ([1e-3, 1e-2], [8, 8, 16], "--lora-rank lists 8 more than once"),
])
def test_a_grid_of_fewer_than_two_points_or_a_repeated_value_is_refused(tmp_path, rates, ranks, message):
    with pytest.raises(ValueError, match=message):
        grid(tmp_path, rates, ranks)


def test_a_rank_above_the_configs_max_lora_rank_is_refused(tmp_path):
    with pytest.raises(ValueError, match="lora_rank 64 is above max_lora_rank 32"):
        grid(tmp_path, [], [8, 64], max_lora_rank=32)


def report(run_id: str, mode: str, status: str, **restore) -> RunReport:
    fields = {name: None for name in RunReport.model_fields}
    fields.update(run_id=run_id, mode=mode, status=status, restore=restore, error=None if status == "passed" else
                  "checks failed: x", metrics=[], checkpoints=[], failures=[], client_runs=[], timings_s={})
    return RunReport.model_construct(**fields)


def test_sft_members_rank_by_held_out_loss_lowest_first_and_failed_ones_last(tmp_path):
    members = grid(tmp_path, [1e-3, 1e-2, 3e-2, 1e-1], [])
    reports = {"sw-00": report("sw-00", "sft", "passed", final_eval_loss=2.5, eval_loss_gain=0.5),
               "sw-01": report("sw-01", "sft", "passed", final_eval_loss=2.1, eval_loss_gain=0.9),
               "sw-02": report("sw-02", "sft", "failed", final_eval_loss=1.0, eval_loss_gain=2.0)}
    result = sweep.ranking(members, reports, {"sw-03": "PreflightError: no"})
    rows = result["members"]
    assert [(r["run_id"], r["rank"]) for r in rows] == [("sw-01", 1), ("sw-00", 2), ("sw-02", None),
                                                         ("sw-03", None)]
    assert result["best"] == "sw-01" and result["failed"] == ["sw-02", "sw-03"]
    assert rows[0]["gain"] == 0.9 and rows[0]["learning_rate"] == 1e-2
    assert rows[3]["error"] == "PreflightError: no" and rows[3]["status"] == "failed"
    table = sweep.markdown("sw", result)
    assert "| 1 | sw-01 | 0.01 | 32 | passed | 2.1 | 0.9 | - |" in table
    assert "| - | sw-03 | 0.1 | 32 | failed: PreflightError: no | - | - | - |" in table


def test_rl_members_rank_by_held_out_reward_highest_first_with_their_p_value(tmp_path):
    members = grid(tmp_path, [1e-3, 1e-2], [], mode="rl")
    reports = {"sw-00": report("sw-00", "rl", "passed", eval_reward=0.31, reward_gain=0.1, sign_flip_p=1e-4),
               "sw-01": report("sw-01", "rl", "passed", eval_reward=0.45, reward_gain=0.2, sign_flip_p=2e-5)}
    result = sweep.ranking(members, reports, {})
    assert (result["ranked_by"], result["lower_is_better"]) == ("eval_reward", False)
    assert [(r["run_id"], r["rank"], r["p_value"]) for r in result["members"]] == [("sw-01", 1, 2e-5),
                                                                                   ("sw-00", 2, 1e-4)]


def test_no_member_passed_means_no_best_and_nothing_to_promote(tmp_path):
    members = grid(tmp_path, [1e-3, 1e-2], [])
    result = sweep.ranking(members, {}, {"sw-00": "x", "sw-01": "y"})
    assert result["best"] is None and result["failed"] == ["sw-00", "sw-01"]
    assert promote.best(members[0], result, {}, "best") is None


@pytest.mark.parametrize(("options", "message"), [
    (["--learning-rate", "1e-3"], "at least two points"),
    (["--learning-rate", "1e-3,fast"], "--learning-rate '1e-3,fast': comma-separated numbers"),
    (["--lora-rank", "8,8"], "--lora-rank lists 8 more than once"),
    (["--learning-rate", "1e-3,1e-2", "--run-id", "x"], "--run-id: a sweep names its runs"),
    (["--learning-rate", "1e-3,1e-2", "--promote-as", "x"], "use --promote-best-as"),
    (["--learning-rate", "1e-3,1e-2", "--promote-best-as", "a b"], "no promotion name"),
    (["--learning-rate", "1e-3,1e-2", "--cluster", "nosuch"], "--cluster nosuch: no such cluster"),
    (["--learning-rate", "1e-3,-1"], "learning_rate"),
])
def test_txflow_sweep_refuses_bad_input_in_one_line_before_anything_starts(capsys, tmp_path, monkeypatch, options,
                                                                           message):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("TXFLOW_CLUSTERS_DIR", str(tmp_path / "clusters"))
    monkeypatch.chdir(tmp_path)
    code = cli_exit(["sweep", "sft", "--base-model", "tiny", "--checkpoints", str(tmp_path / "ckpt"),
                     "--sweep-id", "sw", *options])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "ckpt").exists() and not Path(tmp_path / ".txflow").exists()


@pytest.mark.parametrize("sweep_id", ["sw", "Sweep_LR-2", "sweep-sft-20261202-101500-ab12"])
def test_the_ranking_artifact_key_is_one_prefect_takes_for_every_sweep_id_the_cli_takes(sweep_id):
    from prefect.client.schemas.actions import ArtifactCreate

    ArtifactCreate(key=sweep.artifact_key(sweep_id), type="markdown", data="x")  # raises on a key it refuses
