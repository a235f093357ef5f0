"""Bad input fails before any process starts, with a message that says what to change."""

from __future__ import annotations

import json
import os
import tomllib
import uuid
from pathlib import Path

import fsspec
import pytest

from tests.helpers import run_txflow
from txflow import cli, preflight
from txflow.checkpoints import lease
from txflow.config import RunConfig
from txflow.preflight import PreflightError
from txflow.training.sft import SFTData
from txflow.upstream.tiny_model import build_tiny_model

GOOD_ROW = json.dumps({"prompt": "English: one\nFrench:", "completion": " un\n"})


@pytest.fixture
def cfg_for(tmp_path):
    """A resolved RunConfig whose state and checkpoints live under tmp_path."""

    def make(**fields) -> RunConfig:
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
    data = preflight.prepare(cfg)
    assert isinstance(data, SFTData)
    assert len(data.train) >= 1 and len(data.eval) >= 1
    assert no_cluster_started(cfg)


def test_prepare_rl_loads_prompts_and_the_reward(cfg_for):
    data = preflight.prepare(cfg_for(mode="rl"))
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
    data = preflight.prepare(cfg_for(mode="custom", client=str(client), client_python=str(python)))
    assert data.command == [str(python), str(client)]


def test_prepare_custom_without_client_python_uses_txflows_interpreter(cfg_for, tmp_path):
    import sys

    client = tmp_path / "loop.py"
    client.write_text("")
    assert preflight.prepare(cfg_for(mode="custom", client=str(client))).command == [sys.executable, str(client)]


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


# --- the CLI -------------------------------------------------------------------------


def cli_exit(argv: list[str]) -> int:
    """Exit status of `txflow ARGV` run in-process, as the shell would see it."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


@pytest.fixture
def cli_env(monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")  # main() sets it; restore the environment afterwards


@pytest.mark.parametrize(
    ("options", "names"),
    [
        (["--processes", "0"], "processes must be at least 1"),
        (["--processes", "-2"], "processes must be at least 1"),
        (["--steps", "0"], "steps must be at least 1"),
        (["--run-id", "../x"], "run_id"),
        (["--lora-rank", "0"], "lora_rank"),
        (["--processes", "two"], "processes"),
    ],
)
def test_cli_rejects_invalid_options_with_exit_2_before_any_run(capsys, cli_env, tmp_path, options, names):
    state = tmp_path / "state"
    assert cli_exit(["run", "sft", "--state-dir", str(state), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("txflow: invalid options: ")
    assert names in err
    assert "state directory" not in err  # no run was announced
    assert not state.exists()


def test_cli_rejects_a_storage_option_without_a_value_with_exit_2(capsys, cli_env, tmp_path):
    assert cli_exit(["run", "sft", "--state-dir", str(tmp_path / "s"), "--storage-option", "novalue"]) == 2


# Two real `txflow` subprocesses (~15 s each: imports and Prefect's temporary server) prove that a
# preflight failure inside the flow reaches the shell as exit 2 with the preflight message.


def txflow_line(stderr: str) -> str:
    """The CLI's own final message (Prefect logs the traceback too; this is the line meant for the user)."""
    lines = [line for line in stderr.splitlines() if line.startswith("txflow: ") and " state directory " not in line]
    assert lines, stderr
    return lines[-1]


def test_txflow_run_with_a_missing_base_model_exits_2_before_starting_anything(tmp_path, txflow_env, reaper):
    state = reaper.watch(tmp_path / "state")
    result = run_txflow(["run", "sft", "--base-model", "/nonexistent/dir", "--run-id", "nomodel",
                         "--state-dir", str(state), "--checkpoints", str(tmp_path / "ckpt")],
                        env=txflow_env, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr
    assert txflow_line(result.stderr).startswith("txflow: --base-model /nonexistent/dir: no such directory")
    assert not (state / "cluster.json").exists()
    assert not (tmp_path / "ckpt" / "nomodel").exists()


def test_txflow_run_reusing_a_completed_run_id_exits_2_and_keeps_its_report(tmp_path, txflow_env, reaper):
    state = reaper.watch(tmp_path / "state")
    report = tmp_path / "ckpt" / "finished" / "report.json"
    report.parent.mkdir(parents=True)
    original = json.dumps({"run_id": "finished", "status": "passed"}, indent=2).encode() + b"\n"
    report.write_bytes(original)
    result = run_txflow(["run", "sft", "--run-id", "finished", "--state-dir", str(state),
                         "--checkpoints", str(tmp_path / "ckpt")],
                        env=txflow_env, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr
    message = txflow_line(result.stderr)
    assert "Run finished already completed" in message and "Use another --run-id" in message
    assert report.read_bytes() == original
    assert sorted(p.name for p in report.parent.iterdir()) == ["report.json"]
    assert not (state / "cluster.json").exists()


@pytest.mark.parametrize(("preset", "expected"), [(None, 120.0), ("", 120.0), ("45", 45.0)])
def test_the_embedded_prefect_server_gets_120_s_to_start_unless_told(monkeypatch, preset, expected):
    # Prefect's 20 s default failed a run on a busy machine while the server migrated its new database.
    from txflow.cluster import embedded_prefect

    monkeypatch.delenv(embedded_prefect.STARTUP_TIMEOUT_ENV, raising=False)
    if preset is not None:
        monkeypatch.setenv(embedded_prefect.STARTUP_TIMEOUT_ENV, preset)
    assert embedded_prefect.startup_timeout_s() == expected


# --- one option list, the upstream guard, the fast tokenizer ---------------------------


def _fields(model, prefix=""):
    from pydantic import BaseModel

    for name, info in model.model_fields.items():
        nested = next((a for a in (info.annotation, *getattr(info.annotation, "__args__", ()))
                       if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if nested is not None:
            yield from _fields(nested, prefix + name + ".")
        else:
            yield prefix + name


def test_every_run_config_field_has_a_cli_flag_with_its_description():
    run = cli._parser()._subparsers._group_actions[0].choices["run"]
    by_dest = {a.dest: a for a in run._actions}
    fields = list(_fields(RunConfig))
    assert "mesh.fsdp" in fields and "launcher" in fields and "concurrency_limit" in fields
    missing = [f for f in fields if f not in by_dest]
    assert missing == []
    for field in fields:
        action = by_dest[field]
        if field == "mode":
            assert action.option_strings == []  # the positional argument
            continue
        model = RunConfig.model_fields["mesh"].annotation if field.startswith("mesh.") else RunConfig
        description = model.model_fields[field.split(".")[-1]].description
        assert action.option_strings and description in action.help, field


def test_cli_flags_reach_the_config_nested_and_typed(tmp_path):
    args = cli._parser().parse_args(["run", "rl", "--steps", "7", "--mesh-fsdp", "1", "--processes", "1",
                                     "--storage-option", "key=value", "--client-arg", "a", "--client-arg", "b",
                                     "--startup-timeout", "9", "--concurrency-limit", "slots", "--launcher", "local"])
    cfg = RunConfig.model_validate(cli.config_values(args))
    assert (cfg.mode, cfg.steps, cfg.mesh.fsdp, cfg.processes, cfg.startup_timeout_s) == ("rl", 7, 1, 1, 9.0)
    assert cfg.plain_storage_options() == {"key": "value"} and cfg.client_args == ["a", "b"]
    assert (cfg.concurrency_limit, cfg.launcher) == ("slots", "local")
    # Flags not given leave the model's defaults alone.
    assert cli.config_values(cli._parser().parse_args(["run", "sft"])) == {"mode": "sft"}


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
    from txflow.upstream.tiny_model import build_tiny_model
    from txflow.training.tokenizer import Tokenizer, load_tokenizer

    model = str(build_tiny_model())
    fast, reference = load_tokenizer(model), AutoTokenizer.from_pretrained(model)
    assert isinstance(fast, Tokenizer) and fast.eos_token_id == reference.eos_token_id
    texts = [v for row in load_jsonl(bundled_dataset("sft"), ("prompt", "completion")) for v in row.values()]
    for text in texts:
        ids = fast.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False)
        assert fast.decode(ids + [fast.eos_token_id]) == reference.decode(ids + [fast.eos_token_id],
                                                                           skip_special_tokens=True)


def test_the_readme_documents_every_flag_of_txflow_run():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    run = cli._parser()._subparsers._group_actions[0].choices["run"]
    flags = [flag for action in run._actions for flag in action.option_strings if flag.startswith("--")]
    assert [flag for flag in flags if f"`{flag}" not in readme and f"{flag}`" not in readme] == []


def test_the_txflow_command_hands_over_its_output_and_exit_code(tmp_path):
    # `txflow` leaves without the interpreter's module teardown (cli.entry): what it printed must still
    # arrive whole, and its exit code must still say what it found (1: an incomplete checkpoint).
    sampler = tmp_path / "model_x" / "sampler_weights"
    sampler.mkdir(parents=True)
    (sampler / "step-000001.tar.gz").write_bytes(b"half a save")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout to a pipe is buffered
    result = run_txflow(["discover", str(tmp_path), "--json"], env=env, cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result.stderr
    [artifact] = json.loads(result.stdout)
    assert (artifact["kind"], artifact["complete"], artifact["bytes"]) == ("sampler", False, 11)
    assert tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"] == {
        "txflow": "txflow.cli:entry"}
