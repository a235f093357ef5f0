"""What a run logs to MLflow, without a store: its options as parameters (no credential), its figures as metrics
by step; and `off` switches it off. The store itself is read back in tests/test_shared_cluster_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

from txflow.config import RunConfig
from txflow.reporting import tracking


def test_the_options_are_parameters_flattened_and_no_credential_is_among_them():
    cfg = RunConfig(mode="rl", api_key="tml-secret-key", storage_options={"secret": "s3-secret"},
                    database_url="postgresql://u:pw-secret@127.0.0.1/db", processes=2, mesh={"fsdp": 2},
                    group_size=4)
    params = tracking.params_of(cfg)
    assert params["mode"] == "rl" and params["group_size"] == "4" and params["mesh.fsdp"] == "2"
    assert not {"api_key", "database_url", "storage_options", "tracking_uri", "tracking_parent"} & set(params)
    assert not any("secret" in value for value in params.values()), params


def test_each_steps_figures_are_metrics_at_its_step_and_the_evaluations_at_the_last():
    report = SimpleNamespace(
        metrics=[{"step": 1, "nll": 2.5, "tokens": 12}, {"step": 2, "nll": 2.0, "tokens": 12, "note": "x"}],
        restore={"final_eval_loss": 1.5, "passed": True, "checks": []}, export=None)
    assert tracking.metrics_of(report) == [("nll", 2.5, 1), ("tokens", 12.0, 1), ("nll", 2.0, 2),
                                           ("tokens", 12.0, 2), ("eval/final_eval_loss", 1.5, 2)]


def test_off_logs_nothing_and_the_default_is_the_working_directorys_store(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(tracking.TRACKING_URI_ENV, raising=False)
    assert tracking.tracking_uri(RunConfig()) == f"sqlite:///{tmp_path / '.txflow' / 'mlflow.db'}"
    assert tracking.tracking_uri(RunConfig(tracking_uri="off")) is None
    monkeypatch.setenv(tracking.TRACKING_URI_ENV, "OFF")
    assert tracking.tracking_uri(RunConfig()) is None
    assert tracking.log_run(RunConfig(), SimpleNamespace()) is None  # nothing touched: no store, no error
    assert not (tmp_path / ".txflow").exists()


def test_an_evaluation_is_a_run_of_its_own_and_its_scores_land_on_the_adapters_training_run(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client, experiment = tracking._experiment(uri)
    trained = client.create_run(experiment, run_name="mine", tags={"txflow.run_root": "/runs/mine"}).info.run_id
    other = client.create_run(experiment, run_name="other", tags={"txflow.run_root": "/runs/other"}).info.run_id
    report = {"task": "arithmetic", "harness": "inspect_ai",
              "scores": [{"model": "base", "accuracy": 0.25, "samples": 4, "log": "b.json"},
                         {"model": "mine", "accuracy": 0.75, "samples": 4, "log": "m.json"}]}
    run_id = tracking.log_eval(uri, report, {"mine": "/runs/mine"})
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "eval arithmetic" and run.data.tags["txflow.mode"] == "eval"
    assert run.data.metrics == {"eval/arithmetic/base/accuracy": 0.25, "eval/arithmetic/mine/accuracy": 0.75}
    assert client.get_run(trained).data.metrics == {"eval/arithmetic/accuracy": 0.75,
                                                    "eval/arithmetic/base_accuracy": 0.25}
    assert client.get_run(other).data.metrics == {}  # another run's root: untouched
    assert tracking.log_eval(None, report, {}) is None  # tracking off


def test_the_evaluate_steps_scores_are_metrics_at_the_last_step_the_base_models_beside():
    report = SimpleNamespace(metrics=[{"step": 3, "nll": 1.0}], restore=None, export=None, evaluation={
        "task": "arithmetic", "harness": "inspect_ai",
        "scores": [{"model": "base", "accuracy": 0.25}, {"model": "mine", "accuracy": 0.5}]})
    assert tracking.metrics_of(report)[1:] == [("eval/arithmetic/base_accuracy", 0.25, 3),
                                               ("eval/arithmetic/accuracy", 0.5, 3)]
