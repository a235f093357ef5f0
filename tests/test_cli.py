"""The `txflow` command: its options (one per RunConfig field, documented in docs/options.md), bad options
refused with exit 2 before any run, a preflight failure inside the flow reaching the shell as exit 2,
and its output and exit code handed over whole."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.helpers import run_txflow
from txflow import cli
from txflow.config import FLAT_NAMES, RunConfig


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
        (["--cluster-fallback", "own"], "cluster_fallback own applies to a run attached to a shared cluster"),
        (["--cluster", "warm", "--cluster-fallback", "fresh"], "cluster_fallback"),
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
    # Not echoed: a malformed option is often the secret itself, pasted without its key.
    assert capsys.readouterr().err == ("txflow: invalid options: every --storage-option must be KEY=VALUE (one was "
                                       "not; its text is not shown)\n")
    assert not (tmp_path / "s").exists()


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
    result = run_txflow(["run", "sft", "--base-model", "tiny", "--run-id", "finished", "--state-dir", str(state),
                         "--checkpoints", str(tmp_path / "ckpt")],
                        env=txflow_env, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr
    message = txflow_line(result.stderr)
    assert "Run finished already completed" in message and "Use another --run-id" in message
    assert report.read_bytes() == original
    assert sorted(p.name for p in report.parent.iterdir()) == ["report.json"]
    assert not (state / "cluster.json").exists()


def test_a_run_beaten_to_the_lease_by_one_started_at_the_same_moment_exits_2_with_one_line(
        capsys, cli_env, tmp_path, monkeypatch):
    """Both runs passed pre-flight (no lease yet); the other creates its lease a moment before this one, whose
    conditional create then fails: refused as pre-flight refuses a run, one line naming the live run and exit
    2, before anything starts."""
    from txflow.checkpoints import lease

    create = lease._create

    def the_other_run_first(fs, path, data):
        create(fs, path, json.dumps(json.loads(data) | {"token": "the other run's"}).encode())  # alive: this pid
        return create(fs, path, data)

    monkeypatch.setattr(lease, "_create", the_other_run_first)
    mask = os.umask(0o022)
    try:
        code = cli_exit(["run", "sft", "--run-id", "twin", "--state-dir", str(tmp_path / "state"),
                         "--checkpoints", str(tmp_path / "ckpt")])
    finally:
        os.umask(mask)  # `txflow run` sets the run's own
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"txflow: Run twin is running under {tmp_path / 'ckpt' / 'twin'} (host ") \
        and "one live run per run id" in err and len(err.splitlines()) == 1, err
    # Nothing started: no Prefect server (its log), no cluster; the other run's lease is untouched.
    assert not (tmp_path / "state" / "logs").exists() and not (tmp_path / "state" / "cluster.json").exists()
    assert json.loads((tmp_path / "ckpt" / "twin" / lease.LEASE).read_text())["token"] == "the other run's"


# --- one option list ------------------------------------------------------------------


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
    # An option group's fields land under their flat names (`--group-size` in `group_size`): nested afterwards.
    by_field = {".".join(FLAT_NAMES.get(a.dest, (a.dest,))): a for a in run._actions}
    fields = list(_fields(RunConfig))
    assert {"mesh.fsdp", "launcher", "rl.group_size", "ray.address", "export.enabled"} <= set(fields)
    missing = [f for f in fields if f not in by_field]
    assert missing == []
    for field in fields:
        action = by_field[field]
        if field == "mode":
            assert action.option_strings == []  # the positional argument
            continue
        *parents, name = field.split(".")
        model = RunConfig.model_fields[parents[0]].annotation if parents else RunConfig
        description = model.model_fields[name].description
        assert action.option_strings and description in action.help, field
    assert by_field["rl.group_size"].option_strings == ["--group-size"]  # the flags people already type
    assert by_field["ray.address"].option_strings == ["--ray-address"]
    assert by_field["export.enabled"].option_strings == ["--export", "--no-export"]


def test_cli_flags_reach_the_config_nested_and_typed(tmp_path):
    args = cli._parser().parse_args(["run", "rl", "--steps", "7", "--mesh-fsdp", "1", "--processes", "1",
                                     "--storage-option", "key=value", "--client-arg", "a", "--client-arg", "b",
                                     "--startup-timeout", "9", "--concurrency-limit", "slots", "--launcher", "local"])
    cfg = RunConfig.model_validate(cli.config_values(args))
    assert (cfg.mode, cfg.steps, cfg.mesh.fsdp, cfg.processes, cfg.startup_timeout_s) == ("rl", 7, 1, 1, 9.0)
    assert cfg.plain_storage_options() == {"key": "value"} and cfg.custom.client_args == ["a", "b"]
    assert (cfg.concurrency_limit, cfg.launcher) == ("slots", "local")
    # Flags not given leave the model's defaults alone.
    assert cli.config_values(cli._parser().parse_args(["run", "sft"])) == {"mode": "sft"}


def test_the_options_page_documents_every_flag_of_txflow_run():
    page = (Path(__file__).resolve().parents[1] / "docs" / "options.md").read_text()
    run = cli._parser()._subparsers._group_actions[0].choices["run"]
    flags = [flag for action in run._actions for flag in action.option_strings if flag.startswith("--")]
    assert [flag for flag in flags if f"`{flag}`" not in page] == [], \
        "docs/options.md is out of date: regenerate it with `make docs` and commit it"


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


# A command interrupted while a non-daemon thread is still blocked (a worker waiting on a request to the cluster the
# run's teardown just released): the interpreter's own exit would join that thread without bound.
INTERRUPTED_WITH_A_BLOCKED_THREAD = """
import os, signal, sys, threading, time
from txflow import cli
from txflow.cli.run import on_sigterm

def main():
    threading.Thread(target=time.sleep, args=(600,), name="blocked").start()
    signal.signal(signal.SIGTERM, on_sigterm)
    # Ctrl-C as a terminal's foreground job gets it: a command started in the background (`make test &`)
    # inherits SIGINT ignored, and Python then leaves it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    time.sleep(600)

cli.main = main
cli.entry()
"""


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_an_interrupted_command_exits_as_the_signal_says_without_waiting_on_its_threads(signame):
    """SIGTERM (`txflow run` turns it into Ctrl-C's KeyboardInterrupt) and Ctrl-C: once the interrupt has
    unwound `main` (the flow's teardown with it), the command exits 128 + the signal's number within the
    bounded wait for its threads (10 s), and says it was interrupted in one line, without a traceback."""
    # The thread sleeps 600 s: an exit that waited for it would outlast the timeout.
    result = subprocess.run([sys.executable, "-c", INTERRUPTED_WITH_A_BLOCKED_THREAD, signame], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 128 + getattr(signal, signame), result.stderr[-2000:]
    assert result.stderr.splitlines()[-1] == f"txflow: interrupted ({signame})", result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command, given_by", [(["discover", "s3://bucket/runs"], "flag"),
                                               (["promoted", "s3://bucket/runs", "prod"], "flag"),
                                               (["prune", "s3://bucket/runs", "--dry-run"], "environment")])
def test_storage_option_values_are_masked_in_every_command(tmp_path, command, given_by):
    """Any value may be a credential, and a store's error may echo one (an endpoint URL here, the whole
    of it): each is masked wherever it shows, by flag or by TXFLOW_STORAGE_OPTIONS."""
    endpoint = "http://127.0.0.1:1/option-MARKER-40c1"  # nothing listens: the store's error names it
    env = {**os.environ, "AWS_MAX_ATTEMPTS": "1", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    if given_by == "flag":
        command = [*command, "--storage-option", f"endpoint_url={endpoint}"]
    else:
        env["TXFLOW_STORAGE_OPTIONS"] = json.dumps({"endpoint_url": endpoint})
    result = run_txflow(command, env, tmp_path, timeout=120)
    assert result.returncode != 0 and "option-MARKER" not in result.stdout + result.stderr
    assert "Could not connect to the endpoint URL: \"***/bucket" in result.stderr, result.stderr[-2000:]


def test_version_names_txflow_and_the_upstream_versions_it_adapts(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert re.fullmatch(r"txflow \S+ \(skyrl-tx 0\.3\.0, tinker 0\.13\.1, prefect \S+\)\n", capsys.readouterr().out)


def test_run_help_shows_each_plain_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in ("Optimizer steps. (default: 20)", "LoRA rank of the trained adapter. (default: 32)",
                  "(default: on)", "(default: off)"):
        assert shown in text, shown
    assert "(default: None)" not in text


@pytest.mark.parametrize("suffix", [".yaml", ".toml", ".json"])
def test_a_config_file_gives_the_options_and_a_flag_given_as_well_wins(tmp_path, suffix):
    texts = {".yaml": "steps: 7\nlora-rank: 8\nmesh:\n  tp: 1\nstorage_options:\n  anon: 'false'\n  x-y: '1'\n",
             ".toml": "steps = 7\nlora-rank = 8\n[mesh]\ntp = 1\n[storage_options]\nanon = 'false'\n",
             ".json": '{"steps": 7, "lora-rank": 8, "mesh": {"tp": 1}, "storage_options": {"anon": "false"}}'}
    file = tmp_path / f"run{suffix}"
    file.write_text(texts[suffix])
    args = cli._parser().parse_args(["run", "sft", "--config", str(file), "--steps", "9",
                                     "--storage-option", "key=k"])
    config = RunConfig.model_validate(cli.config_values(args))
    assert (config.steps, config.lora_rank, config.mesh.tp) == (9, 8, 1)
    dashed = {"x-y": "1"} if suffix == ".yaml" else {}  # a dict option's own keys are kept as written
    assert config.plain_storage_options() == {"anon": "false", "key": "k", **dashed}


@pytest.mark.parametrize("text", ["group-size: 4\nmax_tokens: 6\nexport: false\nray_placement: PACK\n",
                                  "rl:\n  group-size: 4\n  max_tokens: 6\nexport:\n  enabled: false\n"
                                  "ray:\n  placement: PACK\n"])
def test_a_groups_options_are_read_flat_or_nested_and_a_flag_wins_either_way(tmp_path, text):
    file = tmp_path / "run.yaml"
    file.write_text(text)
    args = cli._parser().parse_args(["run", "rl", "--config", str(file), "--max-tokens", "3", "--loss", "ppo"])
    config = RunConfig.model_validate(cli.config_values(args))
    assert (config.rl.group_size, config.rl.max_tokens, config.rl.loss) == (4, 3, "ppo")
    assert config.export.enabled is False and config.ray.placement == "PACK"


def test_a_groups_option_given_flat_and_nested_at_once_is_refused_in_one_line():
    with pytest.raises(ValidationError, match="group_size is given twice: as group_size and as rl.group_size"):
        RunConfig.model_validate({"group_size": 4, "rl": {"group_size": 2}})


@pytest.mark.parametrize(("text", "name", "message"), [
    ("stepz: 3\n", "bad.yaml", "stepz: Extra inputs are not permitted"),
    ("steps: [\n", "bad.yaml", "--config {file}: not valid yaml ("),
    ("- 1\n", "bad.yaml", "--config {file}: holds a list, not a table of options"),
    ("steps: 3\n", "bad.ini", "--config {file}: name a .yaml, .toml or .json file"),
    ("mode: rl\n", "bad.yaml", "--config {file} says mode rl, the command says sft"),
])
def test_a_config_file_that_cannot_serve_exits_2_in_one_line(capsys, cli_env, tmp_path, monkeypatch, text, name,
                                                             message):
    monkeypatch.chdir(tmp_path)  # where a run would create .txflow/
    file = tmp_path / name
    file.write_text(text)
    assert cli_exit(["run", "sft", "--config", str(file)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message.format(file=file) in err, err
    assert not (tmp_path / ".txflow").exists()


def test_a_runs_last_line_says_where_the_adapter_is():
    from types import SimpleNamespace

    exported = SimpleNamespace(passed=True, peft_url="s3://b/runs/r1/export/peft")
    report = SimpleNamespace(run_id="r1", status="passed", error=None, export=exported, checkpoint_root="s3://b/runs/r1",
                             promotion=SimpleNamespace(status="promoted", name="prod"))
    assert cli.last_line(report) == ("txflow: run r1 passed; adapter at s3://b/runs/r1/export/peft (promoted as "
                                     "prod); report at s3://b/runs/r1/report.json")
    failed = SimpleNamespace(**{**vars(report), "status": "failed", "error": "checks failed: loss\nmore",
                                "export": SimpleNamespace(passed=False, peft_url=None), "promotion": None})
    assert cli.last_line(failed) == "txflow: run r1 failed (checks failed: loss); report at s3://b/runs/r1/report.json"


def test_sweep_help_lists_no_flag_a_sweep_refuses_and_refuses_it_saying_what_to_use(capsys, cli_env):
    with pytest.raises(SystemExit):
        cli.main(["sweep", "--help"])
    text = capsys.readouterr().out
    for flag in ("--run-id", "--promote-as", "--approve", "--client"):
        assert flag not in text, flag
    assert "--promote-best-as" in text and "--learning-rate" in text
    assert "custom client options" not in text and "RL options" in text  # no heading over nothing
    assert cli_exit(["sweep", "sft", "--learning-rate", "1e-3,1e-2", "--run-id", "x"]) == 2
    assert "--run-id: a sweep names its runs <sweep-id>-NN: use --sweep-id" in capsys.readouterr().err


def test_discover_of_nothing_is_bad_input_exit_2_in_one_line(capsys, cli_env, tmp_path):
    """As every command: 2 on bad input (1 is kept for what discover exists to say: an incomplete artifact)."""
    assert cli_exit(["discover", str(tmp_path / "no-such-root")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("txflow: Nothing was found under"), err


def test_runs_lists_each_run_newest_first_with_its_end_and_adapter(capsys, cli_env, tmp_path):
    for run_id, report in (("old", {"status": "passed", "mode": "sft", "base_model": "tiny", "finished_at": 1.0e9,
                                    "metrics": [{}] * 3, "export": {"passed": True, "peft_url": "X/old/export/peft"}}),
                           ("new", {"status": "failed", "mode": "rl", "finished_at": 2.0e9, "error": "checks failed: "
                                    "reward\nmore", "export": None})):
        (tmp_path / run_id).mkdir()
        (tmp_path / run_id / "report.json").write_text(json.dumps(report))
    (tmp_path / "died" / "m1" / "step-000002").mkdir(parents=True)  # no report, no lease: unfinished
    assert cli_exit(["runs", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["run_id"], r["status"], r["adapter"], r["error"]) for r in rows] == [
        ("new", "failed", None, "checks failed: reward"), ("old", "passed", "X/old/export/peft", None),
        ("died", "unfinished", None, None)]
    assert cli_exit(["runs", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[1].startswith("old") and "3 steps" in lines[1] and "X/old/export/peft" in lines[1]
    assert cli_exit(["runs", str(tmp_path / "nothing")]) == 2


@pytest.mark.parametrize(("text", "seconds"), [("30m", 1800), ("8h", 28800), ("2d", 172800), ("90", 90),
                                               ("1.5h", 5400), ("45s", 45)])
def test_a_key_lifetime_reads_as_people_write_it(text, seconds):
    assert cli.duration_s(text) == seconds


@pytest.mark.parametrize(("argv", "says"), [
    (["cluster", "key", "nowhere"], "cluster nowhere is not up; start it with `txflow cluster up nowhere`"),
    (["cluster", "key", "nowhere", "--ttl", "soon"], "--ttl 'soon': give a duration such as 30m, 8h, 2d"),
    (["cluster", "key", "nowhere", "--label", "../x"], "--label '../x' must be 1-64 letters"),
    (["cluster", "keys", "nowhere"], "no cluster named nowhere under"),
    (["cluster", "keys", "nowhere", "--revoke", "nb"], "no cluster named nowhere under"),
])
def test_a_key_for_a_cluster_that_is_not_there_or_a_bad_ttl_or_label_exits_2_in_one_line(
        capsys, tmp_path, monkeypatch, argv, says):
    monkeypatch.setenv("TXFLOW_CLUSTERS_DIR", str(tmp_path / "clusters"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_a_listing_piped_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """`txflow discover URL | head -1`: the reader closes the pipe; the command exits 0 without a traceback."""
    import subprocess

    from tests.helpers import txflow_cmd

    for i in range(1500):  # more than a pipe buffer's 64 KiB of lines, so that a write meets the closed pipe
        (tmp_path / f"file-{i:04}-{'x' * 40}.json").write_text("{}")
    proc = subprocess.Popen(txflow_cmd("discover", str(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=tmp_path)
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does once it has its line
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, stderr
    assert first.startswith(b"file") and "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
