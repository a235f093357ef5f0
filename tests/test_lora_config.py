"""The LoRA flags a client asks for (txflow.upstream.skyrl_tx.lora_config): what the engine cannot train is
refused in one line that names the flag to pass."""

from __future__ import annotations

import json

from txflow.upstream.skyrl_tx.lora_config import LoraRequest, problem


def model(tmp_path, tied: bool) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": tied}))
    return str(tmp_path)


def test_the_sdks_default_on_a_tied_model_is_refused_naming_the_flag_to_pass(tmp_path):
    reason = problem(LoraRequest(rank=8, train_unembed=True), model(tmp_path, tied=True))
    assert "tie_word_embeddings" in reason and "LoRAEmbed.T" in reason
    assert "Pass train_unembed=False to create_lora_training_client" in reason
    assert "\n" not in reason


def test_a_tied_model_trains_without_the_unembedding(tmp_path):
    assert problem(LoraRequest(rank=8, train_unembed=False), model(tmp_path, tied=True)) is None


def test_an_untied_model_trains_the_unembedding(tmp_path):
    assert problem(LoraRequest(rank=8, train_unembed=True), model(tmp_path, tied=False)) is None


def test_an_adapter_of_nothing_is_refused(tmp_path):
    reason = problem(LoraRequest(rank=8, train_attn=False, train_mlp=False), model(tmp_path, tied=False))
    assert reason.endswith("the adapter would train nothing")
