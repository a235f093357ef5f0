"""The signed checkpoint download (the `rest-surface` change) and the key check around it (`api-key-check`), on a bare
FastAPI app: a signature opens one checkpoint's download until it expires, and nothing else."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from txflow.upstream.skyrl_tx import auth

KEY = "tml-test-key"
DOWNLOAD = "/api/v1/training_runs/model_ab12/checkpoints/sampler_weights/final/download"


class Clock:
    now = 1_000_000.0

    def __call__(self):
        return self.now


@pytest.fixture()
def served():
    app = FastAPI()
    app.add_api_route("/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/download", lambda run, kind, name: name)
    app.add_api_route("/api/v1/training_runs", lambda: "runs")
    clock = Clock()
    signer = auth.DownloadSigner(ttl_s=60, clock=clock)
    auth.install(app, KEY, signer)
    return TestClient(app), signer, clock


def test_a_signed_download_answers_without_the_key_until_it_expires(served):
    client, signer, clock = served
    query, expires = signer.sign(DOWNLOAD)
    assert expires == clock.now + 60
    assert client.get(f"{DOWNLOAD}?{query}").json() == "final"
    clock.now += 60
    assert client.get(f"{DOWNLOAD}?{query}").status_code == 200  # the last second still counts
    clock.now += 1
    refused = client.get(f"{DOWNLOAD}?{query}")
    assert refused.status_code == 403 and "expired or was altered" in refused.json()["detail"]
    assert "\n" not in refused.json()["detail"]


def test_a_tampered_signature_expiry_or_checkpoint_is_refused(served):
    client, signer, _ = served
    query, expires = signer.sign(DOWNLOAD)
    signature = query.split("signature=")[1]
    other = DOWNLOAD.replace("/final/", "/other/")
    tampered = {
        "signature": f"{DOWNLOAD}?expires={expires}&signature={signature[:-1]}{'0' if signature[-1] != '0' else '1'}",
        "expiry": f"{DOWNLOAD}?expires={expires + 3600}&signature={signature}",
        "another checkpoint": f"{other}?{query}",
        "a state of the same name": f"{DOWNLOAD.replace('sampler_weights', 'weights')}?{query}",
    }
    assert {what: client.get(url).status_code for what, url in tampered.items()} == dict.fromkeys(tampered, 403)


def test_a_signature_opens_no_other_route_and_a_download_without_one_needs_the_key(served):
    client, signer, _ = served
    query, _ = signer.sign(DOWNLOAD)
    assert client.get(f"/api/v1/training_runs?{query}").status_code == 401
    assert client.get(DOWNLOAD).status_code == 401
    assert client.get(DOWNLOAD, headers={"X-API-Key": KEY}).json() == "final"


def test_another_api_process_signs_with_another_secret(served):
    client, _, clock = served
    query, _ = auth.DownloadSigner(ttl_s=60, clock=clock).sign(DOWNLOAD)
    assert client.get(f"{DOWNLOAD}?{query}").status_code == 403


EXPORT_FILE = "/api/v1/training_runs/model_ab12/checkpoints/external_weights/download/files/adapter_config.json"


def test_a_signed_export_file_opens_that_file_alone(served):
    """An external-weights export's files (SDK 0.38's `tinker checkpoint download`) are signed one by one."""
    client, signer, _ = served
    client.app.add_api_route("/api/v1/training_runs/{run}/checkpoints/external_weights/{name}/files/{file}",
                             lambda run, name, file: file)
    query, _ = signer.sign(EXPORT_FILE)
    assert client.get(f"{EXPORT_FILE}?{query}").json() == "adapter_config.json"
    other = EXPORT_FILE.replace("adapter_config.json", "adapter_model.safetensors")
    assert client.get(f"{other}?{query}").status_code == 403
    assert client.get(EXPORT_FILE).status_code == 401


def test_a_sampler_save_made_for_an_export_reads_as_save_weights_externals_result():
    from txflow.upstream.skyrl_tx import rest

    saved = {"path": "tinker://model_ab12/sampler_weights/external_weights-download",
             "type": "save_weights_for_sampler"}
    assert rest.external_result(saved) == {"path": "tinker://model_ab12/external_weights/download",
                                           "type": "save_weights_external"}
    plain = {"path": "tinker://model_ab12/sampler_weights/final", "type": "save_weights_for_sampler"}
    assert rest.external_result(plain) is plain
