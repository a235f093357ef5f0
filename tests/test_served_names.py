"""The served model under each of its names (`txflow.upstream.skyrl_tx.served`), on a bare FastAPI app: what
`get_server_capabilities` lists, which `base_model` a client may pass, and what its tokenizer loads from. The
same through a real cluster and SDK, offline: tests/test_cookbook_real_model_e2e.py."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient

from txflow.config import NAMED_MODELS, SMOLLM2_MODEL, RunConfig
from txflow.upstream.skyrl_tx import launch, served
from txflow.upstream.skyrl_tx.served import ServedModel

PATH = "/cache/txflow/smollm2-135m-abc"
HUB_ID = NAMED_MODELS[SMOLLM2_MODEL].hf_id


def test_a_named_model_is_served_by_its_hub_id_its_txflow_name_and_its_path(monkeypatch):
    env = launch.served_model_env(RunConfig(mode="sft", base_model=SMOLLM2_MODEL), PATH)
    monkeypatch.setenv(*next(iter(env.items())))
    model = ServedModel.from_env("ignored when the launcher said")
    assert model.names == (HUB_ID, SMOLLM2_MODEL, PATH) and model.path == PATH
    app = FastAPI()
    served.install(app, model)
    listed = TestClient(app).get("/api/v1/get_server_capabilities").json()["supported_models"]
    assert [m["model_name"] for m in listed] == [HUB_ID, SMOLLM2_MODEL, PATH]


def test_a_model_started_by_hand_or_by_path_is_served_by_that_one_name(monkeypatch):
    monkeypatch.delenv(served.SERVED_ENV, raising=False)
    assert ServedModel.from_env(PATH).names == (PATH,)
    assert ServedModel.of(PATH, PATH).names == (PATH,)  # `--base-model DIR`: its path is its name


def test_every_name_reaches_the_loaded_model_and_another_is_refused_in_one_line():
    model = ServedModel.of(SMOLLM2_MODEL, PATH, HUB_ID)
    for name in (HUB_ID, SMOLLM2_MODEL, PATH):
        assert model.loaded(name) == PATH  # what the engine compares a base-model sample with
        assert model.tokenizer_id(name) == PATH  # what a client's tokenizer loads, offline
    assert model.loaded(None) is None  # a sampler of saved weights names no base model
    with pytest.raises(HTTPException) as refused:
        model.check("HuggingFaceTB/SmolLM2-360M-Instruct")
    assert refused.value.status_code == 400
    assert refused.value.detail == ("base_model 'HuggingFaceTB/SmolLM2-360M-Instruct' is not served by this "
                                    f"cluster; it serves '{HUB_ID}', '{SMOLLM2_MODEL}', '{PATH}'")
    with pytest.raises(HTTPException):
        model.loaded(HUB_ID.lower())  # names are matched exactly
