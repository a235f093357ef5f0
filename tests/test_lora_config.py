"""The LoRA flags a client asks for (txflow.upstream.skyrl_tx.lora_config): what the engine cannot train is
refused in one line; a tied model trains its unembedding (tests/test_tied_unembedding.py)."""

from __future__ import annotations

from txflow.upstream.skyrl_tx.lora_config import LoraRequest, problem


def test_the_sdks_default_trains_the_unembedding_on_any_model():
    assert problem(LoraRequest(rank=8, train_unembed=True)) is None


def test_an_adapter_without_the_unembedding_trains():
    assert problem(LoraRequest(rank=8, train_unembed=False)) is None


def test_an_adapter_of_attention_alone_trains():
    assert problem(LoraRequest(rank=8, train_mlp=False, train_unembed=False)) is None


def test_an_adapter_of_nothing_is_refused():
    reason = problem(LoraRequest(rank=8, train_attn=False, train_mlp=False))
    assert reason.endswith("the adapter would train nothing")
