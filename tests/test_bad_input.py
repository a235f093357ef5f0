"""Bad input: each a clear error before any process starts (table-driven)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from txflow import preflight
from txflow.checkpoints import storage
from txflow.checkpoints.markers import write_commit
from txflow.config import RunConfig
from txflow.preflight import PreflightError
from txflow.processes.ports import free_port
from txflow.training.rewards import RewardError, score

pytestmark = [pytest.mark.timed]


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def orbax_state(root: Path, relative: str, committed: bool) -> str:
    step = root / relative / "checkpoint_0"
    step.mkdir(parents=True)
    for name in ("_CHECKPOINT_METADATA", "_METADATA", "commit_success.txt"):
        (step / name).write_text("{}")
    url = str(root / relative)
    if committed:
        write_commit(url)
    return url


CASES = {
    "missing dataset": (lambda t: {"dataset": str(t / "nope.jsonl")}, "does not exist"),
    "malformed JSONL": (lambda t: {"dataset": write(t / "bad.jsonl", '{"prompt": "a", "completion": "b"}\n{oops\n')},
                        "line 2: not valid JSON"),
    "empty dataset": (lambda t: {"dataset": write(t / "empty.jsonl", "\n\n")}, "has no rows"),
    "prompt longer than the context": (
        lambda t: {"dataset": write(t / "long.jsonl",
                                    json.dumps({"prompt": "word " * 2000, "completion": "x"}) + "\n")},
        "longer than the model's context"),
    "rl prompt longer than the context": (
        lambda t: {"mode": "rl", "dataset": write(t / "long.jsonl", json.dumps({"prompt": "word " * 2000}) + "\n")},
        "exceeds the model's context"),
    "reward cannot be imported": (lambda t: {"mode": "rl", "reward": "nowhere_xyz:fn"}, "cannot import module"),
    "invalid fsspec URL": (lambda t: {"checkpoints": "nosuchproto://bucket/x"}, "not a usable fsspec URL"),
    "root not writable": (lambda t: {"checkpoints": write(t / "a-file", "x") + "/sub"}, "cannot write under"),
    "resume from an incomplete checkpoint": (
        lambda t: {"resume_from": orbax_state(t / "old", "m1/step-000004.tar.gz", committed=False)}, "is incomplete"),
    "resume from a root without states": (lambda t: {"resume_from": write(t / "r" / "x.txt", "x").rsplit("/", 1)[0]},
                                          "no complete, committed state"),
    "missing local model": (lambda t: {"base_model": str(t / "no-model")}, "no such directory"),
    "ray launcher without a cluster to join": (lambda t: {"launcher": "ray"}, "pass --ray-address HOST:PORT or set "
                                                                               "RAY_ADDRESS"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_fails_in_preflight_with_a_clear_message(case, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fields, message = CASES[case]
    cfg = RunConfig(**{"base_model": "tiny", "run_id": "bad", "state_dir": str(tmp_path / "state"),
                       "checkpoints": str(tmp_path / "ckpt"),
                       **fields(tmp_path)}).resolved()
    with pytest.raises(PreflightError, match=message):
        preflight.prepare(cfg)
    assert not (tmp_path / "state" / "cluster.json").exists()


@pytest.mark.parametrize("fields, message", [
    ({"processes": 0}, "at least 1"),
    ({"processes": 2, "mesh": {"fsdp": 3}}, "must equal the device count"),
    ({"mode": "rl", "loss": "reinforce"}, "loss"),
    ({"mode": "dpo"}, "mode"),
    ({"lora_rank": 64, "max_lora_rank": 32}, "above max_lora_rank"),
    ({"api_key": "not-a-tinker-key"}, "tml-"),
])
def test_bad_config_is_rejected_by_the_config_model(fields, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**fields)


def test_resume_from_a_complete_checkpoint_resolves_to_it_and_its_step(tmp_path):
    url = orbax_state(tmp_path / "old", "m1/step-000004.tar.gz", committed=True)
    cfg = RunConfig(run_id="r", state_dir=str(tmp_path / "s"), checkpoints=str(tmp_path / "c"),
                    resume_from=url).resolved()
    assert storage.resolve_resume_from(cfg) == (url, 4)
    newer = orbax_state(tmp_path / "old", "m1/step-000008.tar.gz", committed=True)
    orbax_state(tmp_path / "old", "m1/step-000012.tar.gz", committed=False)
    cfg = cfg.model_copy(update={"resume_from": str(tmp_path / "old")})
    assert storage.resolve_resume_from(cfg) == (newer, 8)  # the latest COMPLETE one


@pytest.mark.parametrize("value", ["0.5", None, float("nan"), True])
def test_reward_that_is_not_a_finite_number_names_the_row(value):
    with pytest.raises(RewardError, match=r"data.jsonl line 3; it must return a finite number"):
        score(lambda *a: value, "mod:fn", "p", "t", [1], {}, "data.jsonl line 3")


# --- the same table through `txflow run`: fast, one line, nothing started --------------------

CLI_CASES = {
    "zero processes": (lambda t: ["--processes", "0"], "processes must be at least 1"),
    "zero steps": (lambda t: ["--steps", "0"], "steps must be at least 1"),
    "mesh that does not match the devices": (lambda t: ["--mesh-fsdp", "3"], "must equal the device count"),
    "unknown loss": (lambda t: ["--loss", "reinforce"], "loss: Input should be 'importance_sampling' or 'ppo'"),
    "api key without the Tinker prefix": (lambda t: ["--api-key", "not-a-tinker-key"], "tml-"),
    "run id that is not a path segment": (lambda t: ["--run-id", "../up"], "run_id"),
    "storage option without a value": (lambda t: ["--storage-option", "novalue"], "must be KEY=VALUE"),
    "missing dataset": (lambda t: ["--dataset", str(t / "nope.jsonl")], "does not exist"),
    "malformed JSONL": (lambda t: ["--dataset", write(t / "bad.jsonl", '{"prompt": "a", "completion": "b"}\n{x\n')],
                        "line 2: not valid JSON"),
    "prompt longer than the context": (
        lambda t: ["--dataset", write(t / "long.jsonl", json.dumps({"prompt": "w " * 2000, "completion": "x"}) + "\n")],
        "longer than the model's context"),
    "missing local model": (lambda t: ["--base-model", str(t / "no-model")], "no such directory"),
    "invalid fsspec URL": (lambda t: ["--checkpoints", "nosuchproto://bucket/x"], "not a usable fsspec URL"),
    "root not writable": (lambda t: ["--checkpoints", write(t / "a-file", "x") + "/sub"], "cannot write under"),
    "a conversation on a model without a chat template": (
        lambda t: ["--dataset", write(t / "chat.jsonl", json.dumps(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")],
        "chat.jsonl line 1: a messages row needs a model with a chat template"),
    "a conversation with no reply": (
        lambda t: ["--dataset", write(t / "chat.jsonl", json.dumps({"messages": [{"role": "user", "content": "hi"}]})
                                      + "\n")], "chat.jsonl line 1: the conversation has no assistant message"),
    "a missing eval dataset": (lambda t: ["--eval-dataset", str(t / "held.jsonl")], "held.jsonl does not exist"),
    "an eval dataset on rl": (lambda t: ["--eval-dataset", str(t / "held.jsonl")],
                              "eval_dataset applies to sft (rl evaluates on the prompts of its dataset)"),
    "reward that cannot be imported": (lambda t: ["--reward", "nowhere_xyz:fn"], "cannot import module"),
    "resume from an incomplete checkpoint": (
        lambda t: ["--resume-from", orbax_state(t / "old", "m1/step-000004.tar.gz", committed=False)],
        "is incomplete"),
    "resume from a state at the last step": (
        lambda t: ["--steps", "4", "--resume-from", orbax_state(t / "old", "m1/step-000004.tar.gz", committed=True)],
        "leaves nothing to train"),
    "custom client that does not exist": (lambda t: ["--client", str(t / "nope.py")], "no such file"),
    "ray launcher without a cluster to join": (lambda t: ["--launcher", "ray"], "never starts a Ray cluster"),
    # Credentials inside a URL: one line naming the option, the credential masked (and nowhere in the output).
    "credentials inside the dataset URL": (
        lambda t: ["--dataset", f"s3://AKIAEXAMPLE:{SECRET}@bucket/data.jsonl"],
        "dataset: Value error, dataset must not hold credentials (user:password@)"),
    "a dataset URL that cannot be read": (lambda t: ["--dataset", "s3://not a bucket/data.jsonl"],
                                          "Dataset s3://not a bucket/data.jsonl cannot be read"),
    # The checkpoint lifecycle.
    "a promotion name that is no path segment": (lambda t: ["--promote-as", "prod/../x"], "promote_as 'prod/../x'"),
    "a promotion without the export it publishes": (lambda t: ["--promote-as", "prod", "--no-export"],
                                                    "promote_as needs export"),
    "keep_last 0": (lambda t: ["--keep-last", "0"], "keep_last: Input should be greater than or equal to 1"),
    "an approval without a Prefect server": (lambda t: ["--promote-as", "prod", "--approve"],
                                             "--approve waits for a person on a Prefect server"),
    "a run id the root keeps for promotions": (lambda t: ["--run-id", "promoted"], "run_id 'promoted' is reserved"),
    "a database nothing listens on": (
        lambda t: ["--database-url", f"postgresql://user:{SECRET}@127.0.0.1:{free_port()}/db"],
        "--database-url postgresql://user:***@127.0.0.1:"),
}
SECRET = "url-secret-MARKER-93d1"


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_bad_input_through_txflow_run_exits_2_within_seconds_with_one_line(case, tmp_path, txflow_env):
    import subprocess
    import time

    from tests.helpers import txflow_cmd

    options, message = CLI_CASES[case]
    rl = case.startswith("reward") or "loss" in case or case.endswith("on rl")
    mode = "rl" if rl else "custom" if "client" in case else "sft"
    home = tmp_path / "empty-prefect-home"
    home.mkdir()
    env = {k: v for k, v in txflow_env.items() if k != "RAY_ADDRESS"} | {"PREFECT_HOME": str(home)}
    given = options(tmp_path)
    run_id = [] if "--run-id" in given else ["--run-id", "bad"]
    args = ["run", mode, "--base-model", "tiny", *run_id, "--state-dir", str(tmp_path / "state"), "--checkpoints",
            str(tmp_path / "ckpt"),
            *given]
    if mode == "custom" and "--client" not in args:
        args += ["--client", str(Path(__file__))]
    began = time.monotonic()
    result = subprocess.run(txflow_cmd(*args), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - began
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert SECRET not in result.stderr + result.stdout
    assert seconds < 15, f"took {seconds:.1f} s"  # a cluster takes longer to start; the checks below say none did
    # Nothing was started: no Prefect server (it would have created its database), no cluster.
    assert list(home.iterdir()) == [] and not (tmp_path / "state" / "cluster.json").exists()


# --- prune and promoted: bad input exits 2 with one line, and nothing is deleted ---------------

def committed_run(root: Path, run_id: str, steps: tuple[int, ...]) -> dict[str, bytes]:
    """A passed run under `root` with committed states at `steps`: {file: content} of everything there."""
    for step in steps:
        orbax_state(root / run_id, f"m1/step-{step:06d}.tar.gz", committed=True)
    write(root / run_id / "report.json", json.dumps({"status": "passed"}))
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


PRUNE_CASES = {
    "prune without saying what": (lambda root: ["prune", str(root)], "say what to prune"),
    "prune keeping 0": (lambda root: ["prune", str(root), "--keep-last", "0"], "--keep-last must be at least 1"),
    "prune keeping no number": (lambda root: ["prune", str(root), "--keep-last", "two"], "invalid int value"),
    "prune of negative days": (lambda root: ["prune", str(root), "--older-than", "-1"], "0 days or more"),
    "prune on one run's root": (lambda root: ["prune", str(root / "r1"), "--keep-last", "1"], "is one run's root"),
    "prune where nothing is": (lambda root: ["prune", str(root / "nothing"), "--keep-last", "1"],
                               "is not a checkpoints root"),
    "prune on a directory without runs": (lambda root: ["prune", str(root / "r1" / "m1" / "step-000002.tar.gz"),
                                                        "--keep-last", "1"], "holds no run directories"),
    "promoted with a name that is no path segment": (lambda root: ["promoted", str(root), "../x"], "no promotion name"),
}


@pytest.mark.parametrize("case", list(PRUNE_CASES))
def test_bad_input_to_prune_and_promoted_exits_2_with_one_line_and_deletes_nothing(case, tmp_path, txflow_env):
    import subprocess

    from tests.helpers import txflow_cmd

    root = tmp_path / "ckpt"
    before = committed_run(root, "r1", (2, 4, 6))
    args, message = PRUNE_CASES[case]
    result = subprocess.run(txflow_cmd(*args(root)), env=txflow_env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} == before
