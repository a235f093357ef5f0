"""Bad input fails before any process starts, with a message that says what to change."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import fsspec
import pytest

import tasks.preflight as preflight_task
from txflow import preflight
from txflow.checkpoints import lease
from txflow.config import RunConfig
from txflow.preflight import PreflightError
from txflow.training.sft import SFTData
from txflow.upstream.tiny_model import build_tiny_model, resolve_base_model

GOOD_ROW = json.dumps({"prompt": "English: one\nFrench:", "completion": " un\n"})


@pytest.fixture
def cfg_for(tmp_path):
    """A resolved RunConfig whose state and checkpoints live under tmp_path."""

    def make(**fields) -> RunConfig:
        fields.setdefault("base_model", "tiny")
        fields.setdefault("run_id", "preflight")
        fields.setdefault("state_dir", str(tmp_path / "state"))
        fields.setdefault("checkpoints", str(tmp_path / "ckpt"))
        return RunConfig(**fields).resolved()

    return make


def model_dir(path: Path, config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 64} if config is None else config))
    return path


def broken_line_3(tmp_path) -> Path:
    path = tmp_path / "broken.jsonl"
    path.write_text(f"{GOOD_ROW}\n{GOOD_ROW}\n{{\"prompt\": \"x\", \n{GOOD_ROW}\n")
    return path


def no_cluster_started(cfg: RunConfig) -> bool:
    return not (Path(cfg.state_dir) / "cluster.json").exists()


# --- check_base_model ----------------------------------------------------------


def test_base_model_that_does_not_exist_says_no_such_directory(cfg_for, tmp_path):
    with pytest.raises(PreflightError, match=r"--base-model /nonexistent/dir: no such directory\. Pass"):
        preflight.check_base_model(cfg_for(base_model="/nonexistent/dir"))


def test_base_model_that_is_a_file_says_no_such_directory(cfg_for, tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x")
    with pytest.raises(PreflightError, match="no such directory"):
        preflight.check_base_model(cfg_for(base_model=str(path)))


def test_base_model_directory_without_config_json_is_not_a_model(cfg_for, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match="has no config.json; it is not a Hugging Face model directory"):
        preflight.check_base_model(cfg_for(base_model=str(tmp_path / "empty")))


def test_base_model_directory_resolves_to_an_absolute_path(cfg_for, tmp_path, monkeypatch):
    model_dir(tmp_path / "models" / "mine")
    monkeypatch.chdir(tmp_path)
    assert preflight.check_base_model(cfg_for(base_model="./models/mine")) == str(tmp_path / "models" / "mine")


def test_tiny_base_model_resolves_to_the_built_model(cfg_for):
    path = Path(preflight.check_base_model(cfg_for(base_model="tiny")))
    assert path == build_tiny_model()
    assert (path / "config.json").exists()


def test_hub_id_is_passed_through(cfg_for):
    assert preflight.check_base_model(cfg_for(base_model="Qwen/Qwen3-8B")) == "Qwen/Qwen3-8B"


@pytest.mark.parametrize(("config", "expected"), [({"max_position_embeddings": 64}, 64), ({}, 1 << 30)])
def test_context_length_comes_from_config_json(tmp_path, config, expected):
    assert preflight.context_length(str(model_dir(tmp_path / "m", config))) == expected


# --- check_run_root ------------------------------------------------------------------


def test_writable_run_root_is_created_and_left_clean(cfg_for):
    cfg = cfg_for()
    preflight.check_run_root(cfg)
    assert Path(cfg.run_root).is_dir()
    assert list(Path(cfg.run_root).iterdir()) == []  # the write probe is removed


def test_run_root_that_already_holds_a_report_says_the_run_completed(cfg_for):
    cfg = cfg_for(run_id="done")
    report = Path(cfg.run_root) / "report.json"
    report.parent.mkdir(parents=True)
    report.write_bytes(b'{"status": "passed"}\n')
    with pytest.raises(PreflightError, match=r"Run done already completed under .*Use another --run-id"):
        preflight.check_run_root(cfg)
    assert report.read_bytes() == b'{"status": "passed"}\n'
    assert sorted(p.name for p in report.parent.iterdir()) == ["report.json"]


def test_a_failed_run_says_it_failed_and_how_to_continue_it(cfg_for):
    cfg = cfg_for(run_id="broken")
    report = Path(cfg.run_root) / "report.json"
    report.parent.mkdir(parents=True)
    report.write_text(json.dumps({"status": "failed", "error": "RuntimeError: export check failed: greedy tokens\n"
                                                               "differ"}))
    with pytest.raises(PreflightError) as info:
        preflight.check_run_root(cfg)
    message = str(info.value)
    assert message.startswith(f"Run broken failed under {cfg.run_root} (RuntimeError: export check failed: greedy "
                               f"tokens); its checkpoints are kept.")
    assert f"--resume-from {cfg.run_root}" in message and "already completed" not in message


@pytest.mark.parametrize("resume", [False, True], ids=["new run", "--resume-from"])
def test_a_run_id_a_live_run_holds_is_refused_naming_it(cfg_for, resume):
    cfg = cfg_for(run_id="live")
    if resume:
        cfg = cfg_for(run_id="live", resume_from=cfg.run_root)
    with lease.held(cfg.run_root, "live"):
        with pytest.raises(PreflightError, match=rf"^Run live is running under {cfg.run_root} \(host .*, pid "
                                                 rf"{os.getpid()}, .*use another --run-id$"):
            preflight.prepare(cfg)
    preflight.check_live_run(cfg)  # that run ended: the id is free


def test_checkpoints_under_a_regular_file_names_the_checkpoints_path(cfg_for, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file")
    checkpoints = str(blocker / "ckpt")
    with pytest.raises(PreflightError) as info:
        preflight.check_run_root(cfg_for(checkpoints=checkpoints))
    assert str(info.value).startswith(f"--checkpoints {checkpoints}: cannot write under {checkpoints}/preflight")
    assert blocker.read_text() == "a file"


def test_run_root_on_another_fsspec_filesystem_is_checked_there(cfg_for):
    base = f"memory://txflow-test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        cfg = cfg_for(checkpoints=base, run_id="again")
        preflight.check_run_root(cfg)
        fs.pipe_file(f"{cfg.run_root}/report.json", b'{"status": "passed"}')
        with pytest.raises(PreflightError, match="already completed"):
            preflight.check_run_root(cfg)
    finally:
        if fs.exists(base):
            fs.rm(base, recursive=True)


def test_checkpoints_with_an_unknown_protocol_is_not_a_usable_url(cfg_for):
    with pytest.raises(PreflightError, match=r"--checkpoints nosuchproto://b: not a usable fsspec URL"):
        preflight.check_run_root(cfg_for(checkpoints="nosuchproto://b"))


# --- prepare -----------------------------------------------------------------------


def test_prepare_of_the_defaults_returns_training_and_eval_data(cfg_for):
    cfg = cfg_for()
    checked = preflight.prepare(cfg)
    assert checked.base_model_path == resolve_base_model(cfg.base_model)  # what the engine will load
    data = checked.data
    assert isinstance(data, SFTData)
    assert len(data.train) >= 1 and len(data.eval) >= 1
    assert no_cluster_started(cfg)


def test_prepare_rl_loads_prompts_and_the_reward(cfg_for):
    data = preflight.prepare(cfg_for(mode="rl")).data
    assert len(data.prompts) == len(data.rows) > 0
    assert data.reward("p", "t", [1, 150], {}) == 0.5


@pytest.mark.parametrize("reward, message", [
    ("no_such_module_xyz:fn", "cannot import module"),
    ("txflow.training.rewards:no_such_fn", "has no function"),
    ("txflow.training.rewards", "must be 'module:function'"),
])
def test_prepare_rl_with_an_unusable_reward_fails(cfg_for, reward, message):
    cfg = cfg_for(mode="rl", reward=reward)
    with pytest.raises(PreflightError, match=message):
        preflight.prepare(cfg)
    assert no_cluster_started(cfg)


def test_a_model_without_a_learning_rate_rule_needs_one_given(cfg_for, tmp_path):
    model = tmp_path / "mistral"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "mistral", "hidden_size": 4096}')
    cfg = cfg_for(base_model=str(model))
    with pytest.raises(PreflightError, match=r"no default learning rate \(the cookbook's rule knows Llama and Qwen "
                                             r"models, and .* is a mistral model\); pass --learning-rate$"):
        preflight.prepare(cfg)
    assert no_cluster_started(cfg)


def test_prepare_rl_with_an_empty_prompt_set_fails(cfg_for, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(PreflightError, match="no rows"):
        preflight.prepare(cfg_for(mode="rl", dataset=str(empty)))


def test_prepare_custom_with_a_missing_client_file_fails(cfg_for, tmp_path):
    with pytest.raises(PreflightError, match="no such file"):
        preflight.prepare(cfg_for(mode="custom", client=str(tmp_path / "missing.py")))


# --- --client-python ------------------------------------------------------------


def client_env(tmp_path, tinker_version: str | None, module: str | None = None) -> Path:
    """A real virtual environment (no pip); with a stand-in `tinker` package of that version if given."""
    import subprocess
    import sys

    root = tmp_path / "client-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next((root / "lib").glob("python3*/site-packages"))
    if tinker_version:
        (site / "tinker").mkdir()
        (site / "tinker" / "__init__.py").write_text(f"__version__ = {tinker_version!r}\n")
    if module:
        (site / f"{module}.py").write_text("")
    return root / "bin" / "python"


def test_client_python_that_does_not_exist_says_no_such_file(cfg_for, tmp_path):
    cfg = cfg_for(mode="custom", client="c.py", client_python=str(tmp_path / "venv" / "bin" / "python"))
    with pytest.raises(PreflightError, match=r"--client-python .*/venv/bin/python: no such file\. Pass the Python"):
        preflight.check_client_python(cfg)


def test_client_python_that_is_not_executable_says_so(cfg_for, tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o644)
    cfg = cfg_for(mode="custom", client="c.py", client_python=str(python))
    with pytest.raises(PreflightError, match="the file is not executable"):
        preflight.check_client_python(cfg)


def test_client_python_that_is_not_a_python_says_so(cfg_for, tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho hello\n")
    fake.chmod(0o755)
    cfg = cfg_for(mode="custom", client="c.py", client_python=str(fake))
    with pytest.raises(PreflightError, match="does not run as a Python interpreter"):
        preflight.check_client_python(cfg)


def test_client_python_without_tinker_says_how_to_install_it(cfg_for, tmp_path):
    python = client_env(tmp_path, tinker_version=None)
    cfg = cfg_for(mode="custom", client="c.py", client_python=str(python))
    with pytest.raises(PreflightError, match=rf"cannot import tinker .*No module named 'tinker'.*Install the Tinker "
                                             rf"SDK into that environment: {python} -m pip install tinker"):
        preflight.check_client_python(cfg)


def test_client_python_is_kept_as_given_and_its_sdk_version_logged(cfg_for, tmp_path, caplog):
    python = client_env(tmp_path, tinker_version="0.38.0")
    cfg = cfg_for(mode="custom", client="c.py", client_python=str(python))
    with caplog.at_level("INFO", logger="txflow"):
        assert preflight.check_client_python(cfg) == str(python)  # the venv's own bin/python, not its target
    assert f"client environment: {python} (Python 3." in caplog.text and "tinker 0.38.0)" in caplog.text


def test_a_module_client_is_looked_up_in_the_client_environment(cfg_for, tmp_path):
    python = client_env(tmp_path, tinker_version="0.25.0", module="their_loop")
    assert preflight.check_client_python(cfg_for(mode="custom", client="their_loop", client_python=str(python)))
    with pytest.raises(PreflightError, match="--client other_loop: not a .py file, and .* finds no module"):
        preflight.check_client_python(cfg_for(mode="custom", client="other_loop", client_python=str(python)))


def test_prepare_custom_runs_the_client_under_the_given_interpreter(cfg_for, tmp_path):
    python = client_env(tmp_path, tinker_version="0.25.0")
    client = tmp_path / "loop.py"
    client.write_text("")
    data = preflight.prepare(cfg_for(mode="custom", client=str(client), client_python=str(python))).data
    assert data.command == [str(python), str(client)]


def test_prepare_custom_without_client_python_uses_txflows_interpreter(cfg_for, tmp_path):
    import sys

    client = tmp_path / "loop.py"
    client.write_text("")
    assert preflight.prepare(cfg_for(mode="custom", client=str(client))).data.command == [sys.executable, str(client)]


def test_prepare_with_a_missing_base_model_fails_before_touching_the_run_root(cfg_for):
    cfg = cfg_for(base_model="/nonexistent/dir")
    with pytest.raises(PreflightError, match="no such directory"):
        preflight.prepare(cfg)
    assert not Path(cfg.run_root).exists()
    assert no_cluster_started(cfg)


def test_prepare_with_a_malformed_dataset_names_line_3(cfg_for, tmp_path):
    dataset = broken_line_3(tmp_path)
    cfg = cfg_for(dataset=str(dataset))
    with pytest.raises(PreflightError, match=rf"^{dataset} line 3: not valid JSON"):
        preflight.prepare(cfg)
    assert no_cluster_started(cfg)


def test_prepare_with_a_missing_dataset_says_it_does_not_exist(cfg_for, tmp_path):
    with pytest.raises(PreflightError, match="does not exist; pass --dataset"):
        preflight.prepare(cfg_for(dataset=str(tmp_path / "missing.jsonl")))


def test_prepare_with_a_row_longer_than_the_context_names_its_line(cfg_for, tmp_path):
    dataset = tmp_path / "long.jsonl"
    long_row = json.dumps({"prompt": "English:", "completion": " deux" * 600})
    dataset.write_text(f"{GOOD_ROW}\n{long_row}\n")
    with pytest.raises(PreflightError, match=rf"^{dataset} line 2: \d+ tokens, longer than the model's context of 512"):
        preflight.prepare(cfg_for(dataset=str(dataset)))


def test_prepare_with_checkpoints_under_a_file_names_the_checkpoints_path(cfg_for, tmp_path):
    (tmp_path / "file").write_text("")
    cfg = cfg_for(checkpoints=str(tmp_path / "file" / "ckpt"))
    with pytest.raises(PreflightError, match=f"^--checkpoints {tmp_path / 'file' / 'ckpt'}: cannot write"):
        preflight.prepare(cfg)
    assert no_cluster_started(cfg)


# --- the upstream guard, the fast tokenizer ---------------------------------------


def test_an_unexpected_skyrl_tx_version_is_refused_at_preflight(cfg_for, monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.4.0" if name == "skyrl-tx" else real(name))
    cfg = cfg_for()
    with pytest.raises(PreflightError, match=r"skyrl-tx 0.4.0 is installed.*install skyrl-tx==0.3.0"):
        preflight.prepare(cfg)
    assert no_cluster_started(cfg)


def test_the_fast_tokenizer_gives_the_ids_transformers_gives(cfg_for):
    from transformers import AutoTokenizer

    from txflow.training.datasets import bundled_dataset, load_jsonl
    from txflow.training.tokenizer import Tokenizer, load_tokenizer
    from txflow.upstream.tiny_model import build_tiny_model

    model = str(build_tiny_model())
    fast, reference = load_tokenizer(model), AutoTokenizer.from_pretrained(model)
    assert isinstance(fast, Tokenizer) and fast.eos_token_id == reference.eos_token_id
    texts = [v for row in load_jsonl(bundled_dataset("sft"), ("prompt", "completion")) for v in row.values()]
    for text in texts:
        ids = fast.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert fast.decode(ids + [fast.eos_token_id]) == reference.decode(ids + [fast.eos_token_id],
                                                                           skip_special_tokens=True)


def test_the_flow_takes_what_txflow_run_checked_and_checks_a_config_itself_otherwise(cfg_for, monkeypatch):
    calls = []
    monkeypatch.setattr(preflight_task, "prepare", lambda cfg: calls.append(cfg) or "checked here")
    cfg = cfg_for()
    given = preflight.Checked(base_model_path="/models/m", data=object())
    assert preflight_task.preflight.fn(cfg, given) is given and calls == []  # `txflow run` checked it: not again
    assert preflight_task.preflight.fn(cfg) == "checked here" and calls == [cfg]  # a deployment's run: checked


def test_a_report_txflow_cannot_read_still_keeps_its_run_id(cfg_for):
    cfg = cfg_for(run_id="garbled")
    report = Path(cfg.run_root) / "report.json"
    report.parent.mkdir(parents=True)
    report.write_bytes(b'{"status": "pass')
    with pytest.raises(PreflightError, match=r"Run garbled ran under .* before \(its report.json is unreadable: "
                                             r".*\); its checkpoints are kept. Use another --run-id"):
        preflight.check_run_root(cfg)
    assert report.read_bytes() == b'{"status": "pass'
