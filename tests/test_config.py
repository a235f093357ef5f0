"""RunConfig validation and derived values, and the SkyRL-tx backend config derived from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from txflow import config
from txflow.config import SMOLLM2_MODEL, TINY_MODEL, RunConfig, default_learning_rate
from txflow.upstream.skyrl_tx.launch import backend_config


def error_text(**fields) -> str:
    with pytest.raises(ValidationError) as info:
        RunConfig(**fields)
    return str(info.value)


# --- validation ----------------------------------------------------------------


def test_defaults_are_valid():
    cfg = RunConfig()
    assert cfg.processes >= 1 and cfg.steps >= 1
    assert cfg.fsdp * cfg.mesh.tp * cfg.mesh.ep == cfg.processes * cfg.devices_per_process


@pytest.mark.parametrize("processes", [0, -1, -8])
def test_processes_below_one_is_rejected(processes):
    assert "at least 1" in error_text(processes=processes)


def test_mesh_whose_product_differs_from_the_device_count_names_both_and_suggests_fsdp():
    message = error_text(processes=2, mesh={"fsdp": 3})
    assert "= 3 must equal the device count 2" in message
    assert "set mesh.fsdp to 2" in message


@pytest.mark.parametrize(
    "fields",
    [
        {"processes": 2, "devices_per_process": 1, "mesh": {"tp": 2}},
        {"processes": 4, "devices_per_process": 2, "mesh": {"fsdp": 2, "tp": 4}},
    ],
    ids=["default-fsdp", "explicit-fsdp"],
)
def test_tensor_parallelism_across_processes_is_rejected(fields):
    message = error_text(**fields)
    assert "spans processes" in message
    assert f"Keep tp <= devices_per_process ({fields['devices_per_process']})" in message


def test_tp_within_one_process_is_accepted():
    cfg = RunConfig(processes=2, devices_per_process=2, mesh={"tp": 2})
    assert (cfg.fsdp, cfg.mesh.tp) == (2, 2)


def test_lora_rank_above_max_lora_rank_is_rejected():
    assert "above max_lora_rank" in error_text(lora_rank=64, max_lora_rank=32)


@pytest.mark.parametrize(
    "run_id",
    [
        "../x",
        "a b",
        "",
        "a/b",
        "-leading-dash",
        "x" * 65,
        "abc\n",
    ],
)
def test_run_id_that_is_not_a_single_path_segment_is_rejected(run_id):
    assert "run_id" in error_text(run_id=run_id)


@pytest.mark.parametrize("run_id", ["a", "sft-20261129-174501-3f2a", "Run_1", "x" * 64])
def test_run_id_of_letters_digits_dash_underscore_is_accepted(run_id):
    assert RunConfig(run_id=run_id).run_id == run_id


@pytest.mark.parametrize("steps", [0, -3])
def test_steps_below_one_is_rejected(steps):
    assert "steps must be at least 1" in error_text(steps=steps)


@pytest.mark.parametrize("typo", [{"step": 5}, {"learning_rte": 0.1}, {"mesh": {"fsdpp": 2}}])
def test_unknown_field_is_rejected(typo):
    assert "Extra inputs are not permitted" in error_text(**typo)


# --- derived values ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sft", "rl", "custom"])
def test_resolved_fills_a_run_id_that_starts_with_the_mode(mode):
    cfg = RunConfig(mode=mode, client="client.py" if mode == "custom" else None).resolved()
    assert cfg.run_id.startswith(f"{mode}-")
    # The generated id passes the run id validation itself.
    assert RunConfig(run_id=cfg.run_id).run_id == cfg.run_id


def test_resolved_run_ids_of_one_second_differ_by_their_random_suffix(monkeypatch):
    # The clock and the random source fixed: two draws of the real ones could collide (1 in 65536).
    monkeypatch.setattr(config.time, "strftime", lambda fmt: "20261129-174501")
    suffixes = iter(["3f2a", "91c0"])
    monkeypatch.setattr(config.secrets, "token_hex", lambda nbytes: next(suffixes))
    first, second = RunConfig().resolved().run_id, RunConfig().resolved().run_id
    assert (first, second) == ("sft-20261129-174501-3f2a", "sft-20261129-174501-91c0")


def test_resolved_keeps_a_given_run_id():
    assert RunConfig(run_id="mine").resolved().run_id == "mine"


def test_resolved_makes_state_dir_and_local_checkpoints_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig(run_id="r1", checkpoints="ckpt", state_dir="state").resolved()
    assert Path(cfg.state_dir) == tmp_path / "state"
    assert Path(cfg.checkpoints) == tmp_path / "ckpt"


def test_resolved_default_state_dir_is_under_txflow_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig(run_id="r1").resolved()
    assert Path(cfg.state_dir) == tmp_path / ".txflow" / "runs" / "r1"
    assert Path(cfg.checkpoints) == tmp_path / ".txflow" / "checkpoints"


def test_resolved_leaves_a_url_checkpoint_root_alone():
    cfg = RunConfig(run_id="r1", checkpoints="s3://bucket/prefix").resolved()
    assert cfg.checkpoints == "s3://bucket/prefix"
    assert cfg.run_root == "s3://bucket/prefix/r1"


@pytest.mark.parametrize(
    ("checkpoints", "run_root"),
    [("/data/ckpt", "/data/ckpt/r1"), ("/data/ckpt/", "/data/ckpt/r1"), ("memory://root", "memory://root/r1")],
)
def test_run_root_is_checkpoints_slash_run_id(checkpoints, run_root):
    assert RunConfig(run_id="r1", checkpoints=checkpoints).resolved().run_root == run_root


def test_plain_storage_options_returns_the_secret_values():
    cfg = RunConfig(storage_options={"key": "AKIA123", "secret": "s3cr3t-value"})
    assert "s3cr3t-value" not in repr(cfg)
    assert cfg.plain_storage_options() == {"key": "AKIA123", "secret": "s3cr3t-value"}


# --- backend_config ------------------------------------------------------------


def test_backend_config_of_two_processes_shards_over_both_and_names_the_coordinator():
    config = backend_config(RunConfig(processes=2), "127.0.0.1:4321")
    assert config["fully_sharded_data_parallel_size"] == 2
    assert config["coordinator_address"] == "127.0.0.1:4321"
    assert config["num_processes"] == 2


@pytest.mark.parametrize("processes", [1, 2, 3, 4, 5, 8, 16])
def test_backend_config_sampling_batch_is_a_multiple_of_fsdp(processes):
    config = backend_config(RunConfig(processes=processes), "127.0.0.1:1")
    fsdp = config["fully_sharded_data_parallel_size"]
    assert fsdp == processes
    assert config["sample_max_num_sequences"] >= fsdp
    assert config["sample_max_num_sequences"] % fsdp == 0


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, 32),
        ({"lora_rank": 8}, 32),
        ({"lora_rank": 64}, 64),
        ({"max_lora_rank": 16, "lora_rank": 16}, 16),
        ({"max_lora_rank": 128}, 128),
    ],
)
def test_backend_config_max_lora_rank(fields, expected):
    """At least the Tinker default of 32 unless the user sets max_lora_rank, then exactly that."""
    assert backend_config(RunConfig(processes=2, **fields), "h:1")["max_lora_rank"] == expected


def test_backend_config_has_room_for_several_adapters():
    assert backend_config(RunConfig(processes=2), "h:1")["max_lora_adapters"] == 8
    assert backend_config(RunConfig(processes=2, lora_adapters=64), "h:1")["max_lora_adapters"] == 64
    with pytest.raises(ValidationError, match="lora_adapters"):
        RunConfig(lora_adapters=4)


def test_backend_config_of_one_process_has_no_coordinator():
    config = backend_config(RunConfig(processes=1), None)
    assert "coordinator_address" not in config
    assert "num_processes" not in config
    assert config["fully_sharded_data_parallel_size"] == 1


@pytest.mark.parametrize("mode, batch_size, learning_rate", [("sft", 4, 2e-2), ("rl", 8, 5e-2)])
def test_resolved_fills_the_defaults_of_the_mode(mode, batch_size, learning_rate):
    cfg = RunConfig(mode=mode, base_model=TINY_MODEL).resolved()
    assert (cfg.batch_size, cfg.learning_rate) == (batch_size, learning_rate)


def test_resolved_keeps_a_given_batch_size_and_learning_rate():
    cfg = RunConfig(mode="rl", batch_size=2, learning_rate=1e-3).resolved()
    assert (cfg.batch_size, cfg.learning_rate) == (2, 1e-3)


def model_dir(tmp_path: Path, model_type: str, hidden_size: int) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": hidden_size}))
    return str(tmp_path)


# The tinker-cookbook's rule, written out: 5e-5 x 10 x (2000 / hidden)^P.
@pytest.mark.parametrize("model_type, hidden_size, expected", [
    ("llama", 576, 1.32e-3),  # SmolLM2-135M: 5e-4 x 3.472^0.781
    ("llama", 2048, 4.91e-4),  # Llama-3.2-1B
    ("qwen3", 4096, 4.73e-4),  # Qwen3-8B: 5e-4 x 0.488^0.0775
    ("qwen2", 896, 5.32e-4),
])
def test_the_learning_rate_of_a_real_model_follows_the_cookbooks_rule(tmp_path, model_type, hidden_size, expected):
    # RL takes half of it: at the full rule the nightly's RL on SmolLM2 collapsed on some seeds (docs/modes.md).
    for mode, share in (("sft", 1.0), ("rl", 0.5)):
        rate, why = default_learning_rate(mode, model_dir(tmp_path, model_type, hidden_size))
        assert rate == pytest.approx(expected * share, rel=5e-3)
        assert f"hidden size {hidden_size}" in why and ("half" in why) == (mode == "rl")
        assert RunConfig(mode=mode, base_model=str(tmp_path)).resolved().learning_rate == rate


def test_a_run_trains_the_real_model_unless_told_otherwise():
    """What a user meets first (`txflow run sft`, the deployments, the demo) trains SmolLM2-135M-Instruct on the
    bundled arithmetic task; the tiny model is for tests where the model does not matter."""
    from txflow.training.datasets import bundled_dataset

    for mode in ("sft", "rl"):
        cfg = RunConfig(mode=mode).resolved()
        assert cfg.base_model == SMOLLM2_MODEL
        assert bundled_dataset(mode, cfg.base_model).endswith(f"arithmetic_{mode}.jsonl")
    assert RunConfig(mode="rl").resolved().rl.reward == "txflow.training.rewards:close_answer"


def test_the_named_real_model_gets_its_rule_without_being_converted():
    assert RunConfig(base_model=SMOLLM2_MODEL).resolved().learning_rate == pytest.approx(1.32e-3, rel=2e-3)


def test_a_given_learning_rate_wins_over_the_models_rule():
    assert RunConfig(base_model=SMOLLM2_MODEL, learning_rate=1e-4).resolved().learning_rate == 1e-4
    assert "(given)" in RunConfig(base_model=SMOLLM2_MODEL, learning_rate=1e-4).resolved().defaults_line()


def test_the_defaults_line_says_where_the_learning_rate_comes_from():
    line = RunConfig(base_model=SMOLLM2_MODEL).resolved().defaults_line()
    assert line.startswith("base model smollm2-135m: learning rate 0.00132 (the cookbook's LoRA rule for a llama "
                           "model of hidden size 576)")
    line = RunConfig(mode="rl", base_model=SMOLLM2_MODEL).resolved().defaults_line()
    assert line.startswith("base model smollm2-135m: learning rate 0.00066 (half the cookbook's LoRA rule for a "
                           "llama model of hidden size 576, for RL)")


@pytest.mark.parametrize("base_model", ["/nowhere/model", "someone/not-cached-model"])
def test_a_model_this_machine_cannot_read_gets_no_learning_rate(base_model):
    assert RunConfig(base_model=base_model).resolved().learning_rate is None
    assert "not on this machine" in default_learning_rate("sft", base_model)[1]


def test_a_family_without_a_rule_gets_no_learning_rate(tmp_path):
    rate, why = default_learning_rate("sft", model_dir(tmp_path, "mistral", 4096))
    assert rate is None and "is a mistral model" in why
    # The flow logs the line before pre-flight refuses the run: it must say so, not fail.
    assert "learning rate none (the cookbook's rule knows Llama and Qwen models" in RunConfig(
        base_model=str(tmp_path)).resolved().defaults_line()


@pytest.mark.parametrize("group_size", [1, 0])
def test_rl_needs_a_group_of_at_least_two(group_size):
    assert "no signal" in error_text(mode="rl", group_size=group_size)


def test_custom_needs_a_client():
    assert "--client" in error_text(mode="custom")


def test_client_python_belongs_to_custom_mode():
    assert "client_python only applies to custom mode" in error_text(mode="sft", client_python="/usr/bin/python3")
    given = RunConfig(mode="custom", client="c.py", client_python="/venv/bin/python")
    assert given.custom.client_python == "/venv/bin/python"


def test_an_attached_run_waits_for_its_cluster_unless_told_to_fall_back_to_its_own():
    assert RunConfig(cluster="warm").cluster_fallback == "wait"
    assert RunConfig(cluster="warm", cluster_fallback="own").cluster_fallback == "own"
    assert "'wait' or 'own'" in error_text(cluster="warm", cluster_fallback="fresh")


def test_falling_back_to_a_cluster_of_its_own_needs_a_shared_cluster_and_a_retry():
    assert "applies to a run attached to a shared cluster" in error_text(cluster_fallback="own")
    assert "set train_retries to 1 or more" in error_text(cluster="warm", cluster_fallback="own", train_retries=0)
    # Waiting is what a run without a shared cluster never does, and the default: no error.
    assert RunConfig(train_retries=0).cluster_fallback == "wait"


@pytest.mark.parametrize("field, value", [("mode", "dpo"), ("loss", "reinforce")])
def test_unknown_mode_or_loss_is_rejected(field, value):
    assert field in error_text(**{field: value})


def test_the_api_key_comes_from_tinker_api_key_however_the_run_starts(monkeypatch):
    # A deployment's worker resolves the config inside the flow: its environment's key is the run's.
    monkeypatch.setenv("TINKER_API_KEY", "tml-from-the-environment")
    assert RunConfig().resolved().api_key.get_secret_value() == "tml-from-the-environment"
    assert RunConfig(api_key="tml-given").resolved().api_key.get_secret_value() == "tml-given"  # given wins
    monkeypatch.setenv("TINKER_API_KEY", "not-a-tinker-key")
    with pytest.raises(ValueError, match="api_key must start with 'tml-'"):
        RunConfig().resolved()
    monkeypatch.delenv("TINKER_API_KEY")
    assert RunConfig().resolved().api_key is None  # the cluster makes a random one


def test_a_real_model_defaults_to_the_arithmetic_task_and_the_tiny_model_keeps_its_toy_one():
    from txflow.training.datasets import bundled_dataset

    tiny = RunConfig(mode="rl", base_model=TINY_MODEL).resolved()
    real = RunConfig(mode="rl", base_model=SMOLLM2_MODEL).resolved()
    assert (tiny.rl.reward, tiny.rl.temperature) == ("txflow.training.rewards:low_token_ids", 0.25)
    assert (real.rl.reward, real.rl.temperature) == ("txflow.training.rewards:close_answer", 1.0)
    given = RunConfig(mode="rl", base_model=SMOLLM2_MODEL, reward="my.mod:fn", temperature=0.7).resolved()
    assert (given.rl.reward, given.rl.temperature) == ("my.mod:fn", 0.7)
    assert bundled_dataset("sft").endswith("sft.jsonl") and bundled_dataset("rl").endswith("rl_prompts.jsonl")
    assert bundled_dataset("sft", SMOLLM2_MODEL).endswith("arithmetic_sft.jsonl")
    assert bundled_dataset("rl", "/models/my-llama").endswith("arithmetic_rl.jsonl")


def test_the_database_url_and_storage_options_come_from_the_environment(monkeypatch):
    # Off every command line: `ps` shows a flag to every local user, the environment only to its owner.
    monkeypatch.setenv("TXFLOW_DATABASE_URL", "postgresql://u:pw-from-env@/db")
    monkeypatch.setenv("TXFLOW_STORAGE_OPTIONS", '{"key": "id", "secret": "from-env"}')
    cfg = RunConfig().resolved()
    assert cfg.database_url.get_secret_value() == "postgresql://u:pw-from-env@/db"
    assert cfg.plain_storage_options() == {"key": "id", "secret": "from-env"}
    given = RunConfig(database_url="sqlite:///given.db", storage_options={"secret": "given"}).resolved()
    assert given.database_url.get_secret_value() == "sqlite:///given.db"  # given wins
    assert given.plain_storage_options() == {"key": "id", "secret": "given"}  # per option
    assert given.resolved().plain_storage_options() == given.plain_storage_options()  # resolving again: the same
    monkeypatch.delenv("TXFLOW_DATABASE_URL")
    monkeypatch.delenv("TXFLOW_STORAGE_OPTIONS")
    assert RunConfig().resolved().database_url is None and RunConfig().resolved().storage_options == {}


@pytest.mark.parametrize("value", ['{"secret": 5}', "secret=not-json-MARKER", '["a"]'])
def test_storage_options_from_the_environment_that_are_no_json_object_are_refused_without_echo(monkeypatch, value):
    monkeypatch.setenv("TXFLOW_STORAGE_OPTIONS", value)
    with pytest.raises(ValueError, match="TXFLOW_STORAGE_OPTIONS must be a JSON object of strings") as refused:
        RunConfig().resolved()
    assert value not in str(refused.value) and "MARKER" not in str(refused.value)


def test_children_inherit_no_credential_variable(monkeypatch):
    from txflow.config import environ_without_secrets

    for name in ("TINKER_API_KEY", "TXFLOW_DATABASE_URL", "TXFLOW_STORAGE_OPTIONS"):
        monkeypatch.setenv(name, "secret")
    monkeypatch.setenv("TXFLOW_TEST_PLAIN", "kept")
    env = environ_without_secrets()
    assert env["TXFLOW_TEST_PLAIN"] == "kept"
    assert {"TINKER_API_KEY", "TXFLOW_DATABASE_URL", "TXFLOW_STORAGE_OPTIONS"}.isdisjoint(env)


def test_an_evaluation_task_belongs_to_sft_and_rl():
    assert "eval_task applies to sft and rl" in error_text(mode="custom", client="c.py", eval_task="arithmetic")
    assert RunConfig(mode="rl", eval_task="arithmetic").eval_task == "arithmetic"


def test_backend_config_computes_logprobs_in_chunks_of_a_few_hundred_positions():
    # Upstream's 1024 positions make a chunk's float32 logits 200 MB on SmolLM2's vocabulary, held in several copies
    from txflow.upstream.skyrl_tx import models

    for processes in (1, 2):
        assert backend_config(RunConfig(processes=processes), "h:1")["loss_chunk_size"] == models.LOGPROBS_CHUNK
    assert 64 <= models.LOGPROBS_CHUNK <= 256
