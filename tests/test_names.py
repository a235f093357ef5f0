"""Names are checked where they become paths: a cluster's name, a promotion's name and a
sweep's, from the CLI, from a flow's parameters and in the code that makes the path, before anything acts."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from flows.cluster import cluster_flow
from flows.sweep import sweep_flow
from tests.helpers import run_txflow
from txflow.checkpoints import promotion
from txflow.cluster import named
from txflow.config import RunConfig

NOT_NAMES = ["../evil", "/abs/path", "", "a/b", ".hidden"]


@pytest.mark.parametrize("name", NOT_NAMES)
def test_a_cluster_name_that_is_a_path_is_refused_by_every_way_in(name, tmp_path, monkeypatch):
    monkeypatch.setenv(named.CLUSTERS_DIR_ENV, str(tmp_path / "clusters"))
    for action in (named.status, named.down, lambda n: named.up(RunConfig(), n)):
        with pytest.raises(ValueError, match=f"cluster name {name!r} must be 1-64 letters"):
            action(name)
    with pytest.raises(ValueError, match="cluster name"):
        cluster_flow.fn(name=name, config=RunConfig())  # the Prefect UI's parameter
    assert not (tmp_path / "clusters").exists()


def test_txflow_cluster_down_of_an_absolute_path_signals_nothing_and_deletes_nothing(tmp_path, txflow_env):
    """The reproduction: `cluster_dir('/abs/path')` was that path, so `down` signalled the pid in a foreign
    `serves.json` and `up` deleted `tinker.db*` there. Now both exit 2 in one line and leave it as it was."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (foreign / "serves.json").write_text(json.dumps({"name": "x", "holder_pid": sleeper.pid}))
        (foreign / "tinker.db").write_text("someone's database")
        env = txflow_env | {named.CLUSTERS_DIR_ENV: str(tmp_path / "clusters")}
        for action in ("down", "status", "up"):
            result = run_txflow(["cluster", action, str(foreign)], env, tmp_path, timeout=120)
            assert result.returncode == 2, result.stderr
            assert result.stderr.strip() == f"txflow: cluster name {str(foreign)!r} must be 1-64 letters, digits, " \
                                            "'-' or '_'", result.stderr
        assert sleeper.poll() is None and (foreign / "tinker.db").read_text() == "someone's database"
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()


@pytest.mark.parametrize("name", NOT_NAMES)
def test_a_promotion_name_that_is_a_path_is_refused_where_it_becomes_one(name, tmp_path):
    for action in (lambda: promotion.current(str(tmp_path), name), lambda: promotion.history(str(tmp_path), name),
                   lambda: promotion.promote(str(tmp_path), name, "r", {"peft": str(tmp_path / "x")}, {})):
        with pytest.raises(ValueError, match="must be 1-64 letters, digits, '.', '-' or '_'"):
            action()
    assert os.listdir(tmp_path) == []


def test_a_sweep_from_its_flow_parameters_refuses_a_bad_promotion_name_before_anything_trains(tmp_path):
    config = RunConfig(base_model="tiny", checkpoints=str(tmp_path / "ckpt"), state_dir=str(tmp_path / "sweep"))
    with pytest.raises(ValueError, match="promote_best_as '../../evil' must be"):
        sweep_flow.fn(config=config, learning_rates=[1e-4, 2e-4], promote_best_as="../../evil")
    with pytest.raises(ValueError, match="sweep_id '../x' must be"):
        sweep_flow.fn(config=config, learning_rates=[1e-4, 2e-4], sweep_id="../x")
    assert os.listdir(tmp_path) == []
