"""No credential reaches a log line: txflow.log.redact and the txflow.log helpers."""

from __future__ import annotations

import logging

import pytest

from txflow import log
from txflow.config import RunConfig
from txflow.log import redact


@pytest.fixture(autouse=True)
def no_registered_secrets(monkeypatch):
    """Each test starts with an empty secret registry and leaves the process-wide one untouched."""
    monkeypatch.setattr(log, "_secrets", set())


def test_url_password_is_masked_but_user_and_host_are_kept():
    text = "connecting to postgresql://txuser:pa55word@db.example:5432/txdb now"
    assert redact(text) == "connecting to postgresql://txuser:***@db.example:5432/txdb now"


@pytest.mark.parametrize(
    ("text", "secret", "kept"),
    [
        ("secret_key=abc123 region=eu", "abc123", "region=eu"),
        ('{"secret_key": "abc123", "endpoint": "http://h"}', "abc123", '"endpoint": "http://h"'),
        ("aws_secret_access_key=wJalrXUtnFEMI/K7MDENG", "wJalrXUtnFEMI", "aws_secret_access_key="),
        ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI", "wJalrXUtnFEMI", "AWS_SECRET_ACCESS_KEY="),
        ("api_key=sk-live-0123 model=x", "sk-live-0123", "model=x"),
        ("api-key: sk-live-0123", "sk-live-0123", "api-key"),
        ("token=tok_987654", "tok_987654", "token="),
        ("password='hunter22x'", "hunter22x", "password="),
    ],
)
def test_secret_looking_pairs_are_masked(text, secret, kept):
    out = redact(text)
    assert secret not in out
    assert "***" in out
    assert kept in out


def test_each_explicit_secret_is_masked_wherever_it_appears():
    text = "cmd --x OtherMarker9 --y S3cretMarker; echo OtherMarker9"
    out = redact(text, ["S3cretMarker", "OtherMarker9"])
    assert "S3cretMarker" not in out and "OtherMarker9" not in out
    assert out == "cmd --x *** --y ***; echo ***"


@pytest.mark.parametrize(
    "text",
    [
        "step 3/20 nll 1.2345 tokens 120 0.50s",
        "cluster ready: all 2 ranks served a one-token sample (3.1 s)",
        "custom client: python -m recipe max_tokens=5 env=arithmetic",
        "http://127.0.0.1:8000/api/v1/healthz",
        'backend config {"fully_sharded_data_parallel_size": 2, "max_lora_rank": 32}',
        "",
    ],
)
def test_text_without_secrets_is_unchanged(text):
    assert redact(text) == text
    assert redact(text, ["S3cretMarker"]) == text


def test_registered_secret_is_scrubbed():
    log.register_secret("R3gisteredValue")
    assert log.scrub("value R3gisteredValue, again R3gisteredValue") == "value ***, again ***"


@pytest.mark.parametrize("value", [None, "", "abc"])
def test_empty_or_very_short_values_are_not_registered(value):
    """Masking a 3-character value would garble ordinary text."""
    log.register_secret(value)
    assert log.scrub("abc def") == "abc def"


def run_config_with_secrets() -> RunConfig:
    return RunConfig(
        database_url="postgresql://u:S3cretMarker@/db?host=/tmp",
        storage_options={"secret": "OtherMarker9", "key": "AKIAKEYID"},
    )


def test_run_secrets_are_scrubbed_even_outside_a_url_or_pair():
    log.register_run_secrets(run_config_with_secrets())
    out = log.scrub("db pw S3cretMarker; s3 secret OtherMarker9")
    assert "S3cretMarker" not in out and "OtherMarker9" not in out
    assert out == "db pw ***; s3 secret ***"


def test_run_without_database_url_registers_only_storage_options():
    log.register_run_secrets(RunConfig(storage_options={"secret": "OtherMarker9"}))
    assert log.scrub("OtherMarker9") == "***"


def test_logger_outside_a_prefect_run_emits_scrubbed_records(caplog):
    log.register_run_secrets(run_config_with_secrets())
    caplog.set_level(logging.INFO, logger="txflow")
    logger = log.get_logger()
    logger.info("engine uses S3cretMarker and OtherMarker9 via postgresql://u:S3cretMarker@/db")
    messages = [r.getMessage() for r in caplog.records if r.name == "txflow"]
    assert len(messages) == 1
    assert "S3cretMarker" not in messages[0] and "OtherMarker9" not in messages[0]
    assert "engine uses *** and ***" in messages[0]
    assert "S3cretMarker" not in caplog.text


@pytest.mark.parametrize("url, secret, kept", [
    ("https://acct.blob.core.windows.net/c/sft.jsonl?sv=2024-08-04&sp=r&sig=AbC%2Fq1w2e3", "AbC%2Fq1w2e3",
     "sv=2024-08-04"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAX%2F20261202%2Fus&"
     "X-Amz-Signature=f00dfeed&X-Amz-Expires=60", "f00dfeed", "X-Amz-Expires=60"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAX%2F20261202&X-Amz-Expires=60", "AKIAX", "X-Amz-Expires=60"),
    ("https://b.s3.amazonaws.com/k?X-Amz-Security-Token=IQoJb3JpZ2lu&a=1", "IQoJb3JpZ2lu", "a=1"),
    ("https://storage.googleapis.com/b/o?X-Goog-Algorithm=GOOG4&X-Goog-Signature=0a1b2c3d", "0a1b2c3d", "GOOG4"),
    ("http://h/data.jsonl?token=t0k3nValue&max_tokens=5", "t0k3nValue", "max_tokens=5"),
    ("loading https://h/x.jsonl?key=AIzaSyK3y#frag failed", "AIzaSyK3y", "#frag failed"),
])
def test_query_string_credentials_are_masked(url, secret, kept):
    out = redact(url)
    assert secret not in out and kept in out and "***" in out


def test_a_signed_dataset_url_registers_its_signature_wherever_it_shows_later():
    log.register_run_secrets(RunConfig(dataset="s3://b/data/sft.jsonl?sig=SigMarker77"))
    # An error that names the object by its key without the `sig=` before it.
    assert log.scrub("NoSuchKey: data/sft.jsonl%3Fsig%3DSigMarker77 / SigMarker77") == \
        "NoSuchKey: data/sft.jsonl%3Fsig%3D*** / ***"
