"""Tinker calls that do what Tinker documents, driven by the tinker 0.13.1 SDK of this environment against one real
1-process cluster on the tiny model: load_state against load_state_with_optimizer (the `load-optimizer-flag` change),
the sampler path and its use (`tinker-sampler-paths`), weights_info and the client recreated from it (`lora-flags`), and
the sampling parameters the SDK's types allow (`sampling-params`); the REST surface (`rest-surface`); and, on the same
cluster, every public method and CLI command of SDKs 0.13.1, 0.25.0 and 0.38.0, each probed by
tests/clients/compat_probe.py in its own environment, written into docs/tinker-compatibility.md."""

from __future__ import annotations

from pathlib import Path

import pytest
from flax import serialization
from tinker import types

from tasks.launch_workers import launch_workers
from tasks.provision_coordinator import provision_coordinator
from tasks.teardown import teardown
from txflow.cluster.launchers.local import LocalLauncher
from txflow.config import RunConfig
from txflow.upstream.skyrl_tx import layout
from txflow.upstream.tiny_model import resolve_base_model

pytestmark = [pytest.mark.e2e, pytest.mark.together]

TIMEOUT = 120
BATCH = [[5, 17, 42, 99, 7, 12, 0], [3, 14, 15, 92, 65, 35, 0]]
DATA = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                    loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)}) for t in BATCH]
ADAM = types.AdamParams(learning_rate=1e-2)
PROMPT = types.ModelInput.from_ints([5, 17, 42])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("semantics")
    # 48 adapters: the module's own clients and about 9 per SDK of the compatibility probes (their sessions keep
    # theirs until the engine's session timeout).
    cfg = RunConfig(base_model="tiny", processes=1, lora_adapters=48, run_id="semantics", state_dir=str(tmp / "state"),
                    checkpoints=str(tmp / "ckpt")).resolved()
    handle = provision_coordinator.fn(cfg, LocalLauncher(), resolve_base_model(cfg.base_model))
    try:
        launch_workers.fn(cfg, handle)
        yield cfg, handle, handle.service_client()
    finally:
        teardown.fn(handle, cfg.state_dir)


def wait(handle, future):
    return handle.wait(future, "a request", TIMEOUT)


def step(handle, client) -> None:
    forward_backward = client.forward_backward(DATA, "cross_entropy")
    optim = client.optim_step(ADAM)
    wait(handle, forward_backward)
    wait(handle, optim)


def loss(handle, client) -> float:
    """The batch's summed NLL now: after a step, it tells one update from another."""
    output = wait(handle, client.forward(DATA, "cross_entropy"))
    return -sum(lp for out in output.loss_fn_outputs for lp in out["logprobs"].tolist())


def new_client(handle, service, **modules):
    return handle.call(lambda: service.create_lora_training_client(
        base_model=handle.cluster.base_model_path, rank=8, seed=3, **modules), "creating a client", TIMEOUT)


def with_state_of(cfg, handle, weights_from: str, optimizer_from: str, name: str) -> str:
    """A state checkpoint holding the weights of one saved state and the optimizer of another, registered
    under the first one's model: the reference a load has to match."""
    model_id = layout.parse_tinker_path(weights_from)[0]
    base = Path(handle.cluster.checkpoints_base)

    def record(path):
        return serialization.msgpack_restore((base / layout.relative_checkpoint_path(path) / layout.STATE_FILE)
                                             .read_bytes())

    weights, optimizer = record(weights_from), record(optimizer_from)
    arrays = {k: v for k, v in weights["arrays"].items() if k.startswith("['lora_weights']")}
    arrays |= {k: v for k, v in optimizer["arrays"].items() if k.startswith("['optimizer_state']")}
    assert len(arrays) == len(weights["arrays"])
    directory = base / model_id / f"{name}.tar.gz"
    directory.mkdir()
    (directory / layout.STATE_FILE).write_bytes(serialization.msgpack_serialize({**weights, "arrays": arrays}))
    layout.register_checkpoint(cfg.resolved_database_url(), model_id, name, "state")
    return layout.tinker_path(model_id, "state", name)


def test_load_state_starts_a_fresh_optimizer_and_load_state_with_optimizer_continues(cluster):
    cfg, handle, service = cluster
    original = new_client(handle, service)
    never_stepped = wait(handle, original.save_state("never-stepped")).path
    for _ in range(3):
        step(handle, original)
    saved = wait(handle, original.save_state("step-3")).path
    step(handle, original)
    uninterrupted = loss(handle, original)
    # Step 3's weights with an optimizer that never stepped: what `load_state` must give the next step.
    fresh_optimizer = with_state_of(cfg, handle, saved, never_stepped, "step-3-fresh-optimizer")
    reference = new_client(handle, service)
    wait(handle, reference.load_state_with_optimizer(fresh_optimizer))
    step(handle, reference)
    fresh = loss(handle, reference)
    assert fresh != pytest.approx(uninterrupted, rel=1e-6)  # Adam's moments matter to this step

    def after_one_step(client) -> float:
        step(handle, client)
        return loss(handle, client)

    from_state = handle.call(lambda: service.create_training_client_from_state(saved), "restoring", TIMEOUT)
    with_optimizer = handle.call(lambda: service.create_training_client_from_state_with_optimizer(saved),
                                 "restoring", TIMEOUT)
    assert after_one_step(from_state) == fresh
    assert after_one_step(with_optimizer) == uninterrupted
    # The same on a client that has trained since: its own moments go too, or are replaced.
    wait(handle, original.load_state(saved))
    assert after_one_step(original) == fresh
    wait(handle, original.load_state_with_optimizer(saved))
    assert after_one_step(original) == uninterrupted


def test_a_sampler_path_is_tinkers_and_samples_in_either_form(cluster):
    _, handle, service = cluster
    client = new_client(handle, service)
    step(handle, client)
    path = wait(handle, client.save_weights_for_sampler("sampler-1")).path
    assert path == f"tinker://{client.model_id}/sampler_weights/sampler-1"
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(path)  # what every SDK path helper calls first
    assert (parsed.training_run_id, parsed.checkpoint_type) == (client.model_id, "sampler")
    params = types.SamplingParams(max_tokens=4, temperature=0.0, seed=0)
    tokens = []
    for model_path in (path, f"tinker://{client.model_id}/sampler-1"):  # upstream's old form still accepted
        sampler = service.create_sampling_client(model_path=model_path)
        tokens.append(list(wait(handle, sampler.sample(PROMPT, 1, params)).sequences[0].tokens))
    assert len(tokens[0]) == 4 and tokens[0] == tokens[1]


def test_a_client_recreated_from_a_state_trains_the_modules_the_original_trained(cluster):
    cfg, handle, service = cluster
    original = new_client(handle, service, train_attn=True, train_mlp=False, train_unembed=False)
    step(handle, original)
    saved = wait(handle, original.save_state("attention-only")).path
    info = service.create_rest_client().get_weights_info_by_tinker_path(saved).result()
    assert (info.lora_rank, info.train_attn, info.train_mlp, info.train_unembed) == (8, True, False, False)
    # tinker 0.13.1 creates the new adapter from weights_info, True for every flag left out.
    restored = handle.call(lambda: service.create_training_client_from_state(saved), "restoring", TIMEOUT)
    lora = layout.model_lora(cfg.resolved_database_url(), restored.model_id)
    assert (lora["rank"], lora["train_attn"], lora["train_mlp"], lora["train_unembed"]) == (8, True, False, False)
    step(handle, restored)
    sampler = wait(handle, restored.save_weights_for_sampler("attention-only")).path
    tarball = Path(handle.cluster.checkpoints_base) / layout.relative_checkpoint_path(sampler)
    assert adapter_modules(tarball) == {"q_proj", "k_proj", "v_proj", "o_proj"}


def adapter_modules(tarball: Path) -> set[str]:
    import tarfile

    import safetensors.numpy

    with tarfile.open(tarball) as tar:
        weights = tar.extractfile("adapter_model.safetensors").read()
    return {key.split(".lora_")[0].rsplit(".", 1)[1] for key in safetensors.numpy.load(weights)}


@pytest.fixture(scope="module")
def sampler(cluster):
    """A sampling client of a trained adapter, what it samples with no stop, and the adapter's training client."""
    _, handle, service = cluster
    client = new_client(handle, service)
    step(handle, client)
    sampling = service.create_sampling_client(model_path=wait(handle, client.save_weights_for_sampler("stops")).path)
    return sampling, sample(handle, sampling, stop=None), client


def sample(handle, sampling, **params):
    """8 tokens at temperature 1 with a fixed seed: the same tokens each time until a stop cuts them."""
    response = wait(handle, sampling.sample(PROMPT, 1, types.SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                                                                            **params)))
    return response.sequences[0]


def test_stop_is_read_as_the_sdks_types_allow_a_string_strings_or_token_ids(cluster, sampler):
    from transformers import AutoTokenizer

    _, handle, _ = cluster
    sampling, free, _ = sampler
    tokens = list(free.tokens)
    assert free.stop_reason == "length" and len(tokens) == 8
    # The first token after the first one that it has not sampled before: a stop there cuts the rest.
    cut = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    by_token = sample(handle, sampling, stop=[tokens[cut]])
    assert (by_token.stop_reason, list(by_token.tokens)) == ("stop", tokens[:cut + 1])
    # A character of the text before the last token: a stop string there cuts at least that token.
    text = AutoTokenizer.from_pretrained(handle.cluster.base_model_path).decode(tokens[:-1])
    stop = next(c for c in text if not c.isspace())
    as_list, as_string = sample(handle, sampling, stop=[stop]), sample(handle, sampling, stop=stop)
    assert as_list.stop_reason == "stop" and len(as_list.tokens) < len(tokens)
    assert (as_string.stop_reason, list(as_string.tokens)) == (as_list.stop_reason, list(as_list.tokens))


def test_prompt_logprobs_are_tinkers_and_top_k_ones_refused_in_one_line(cluster, sampler):
    import tinker

    _, handle, _ = cluster
    sampling, _, training = sampler
    params = types.SamplingParams(max_tokens=2, temperature=0.0, seed=0)
    served = wait(handle, sampling.sample(PROMPT, 1, params, include_prompt_logprobs=True)).prompt_logprobs
    # One per prompt token, None at position 0 (the `prompt-logprobs` change); then each token's own logprob, the one
    # the training client computes for it as a target.
    tokens = PROMPT.to_ints()
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    targets = wait(handle, training.forward([datum], "cross_entropy")).loss_fn_outputs[0]["logprobs"].tolist()
    assert len(served) == len(tokens) and served[0] is None
    assert served[1:] == pytest.approx(targets, abs=1e-4)
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs: not served by this cluster") as refused:
        wait(handle, sampling.sample(PROMPT, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3))
    assert "\n" not in str(refused.value)


# --- the REST surface (the `rest-surface` change) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(cluster):
    """A trained client with one state and one sampler checkpoint, and the SDK's RestClient."""
    _, handle, service = cluster
    client = new_client(handle, service)
    step(handle, client)
    state = wait(handle, client.save_state("rest-state")).path
    sampler = wait(handle, client.save_weights_for_sampler("rest-sampler")).path
    return client, state, sampler, service.create_rest_client()


def fetch(url: str) -> tuple[int, bytes]:
    """GET `url` with plain urllib and no key, as the cookbook and `tinker checkpoint download` do."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()


def test_an_archive_url_downloads_that_checkpoint_without_the_key_and_nothing_else(cluster, saved):
    import io
    import tarfile
    import time
    from urllib.parse import urlsplit

    _, handle, _ = cluster
    client, state, sampler, rest = saved
    base = Path(handle.cluster.checkpoints_base)
    url = rest.get_checkpoint_archive_url_from_tinker_path(sampler).result()
    assert 0 < url.expires.timestamp() - time.time() <= 15 * 60 + 5  # as the SDK reads the Expires header
    assert fetch(url.url) == (200, (base / layout.relative_checkpoint_path(sampler)).read_bytes())
    # The state checkpoint: its one file, tarred.
    status, body = fetch(rest.get_checkpoint_archive_url_from_tinker_path(state).result().url)
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        assert (status, tar.getnames()) == (200, [layout.STATE_FILE])
        assert tar.extractfile(layout.STATE_FILE).read() == \
            (base / layout.relative_checkpoint_path(state) / layout.STATE_FILE).read_bytes()
    # Upstream's path form (a bare sampler name) is signed too.
    bare = rest.get_checkpoint_archive_url(client.model_id, "rest-sampler").result().url
    assert fetch(bare)[0] == 200
    # Altered: another checkpoint under the same signature, or a later expiry; no signature at all.
    parts = urlsplit(url.url)
    expires = int(dict(p.split("=") for p in parts.query.split("&"))["expires"])
    elsewhere = url.url.replace("/rest-sampler/", "/stops/")
    later = url.url.replace(f"expires={expires}", f"expires={expires + 3600}")
    assert [fetch(u)[0] for u in (elsewhere, later)] == [403, 403]
    assert "expired or was altered" in fetch(later)[1].decode()
    assert fetch(url.url.split("?")[0])[0] == 401


def test_tinker_checkpoint_download_extracts_the_sampler_adapter(cluster, saved, tmp_path):
    import os
    import subprocess
    import sys

    _, handle, _ = cluster
    _, _, sampler, _ = saved
    env = {**os.environ, "TINKER_BASE_URL": handle.cluster.base_url,
           "TINKER_API_KEY": handle.cluster.api_key.get_secret_value(), "TINKER_TELEMETRY": "0"}
    done = subprocess.run([sys.executable, "-m", "tinker.cli", "checkpoint", "download", sampler, "-o", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    extracted = tmp_path / sampler.removeprefix("tinker://").replace("/", "_")
    assert {p.name for p in extracted.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}


def test_checkpoints_sessions_training_runs_and_info_answer_what_the_cluster_holds(saved):
    import tinker

    client, state, sampler, rest = saved
    listed = rest.list_user_checkpoints(limit=1000).result()
    by_path = {c.tinker_path: c for c in listed.checkpoints}
    assert (by_path[state].checkpoint_type, by_path[sampler].checkpoint_type) == ("training", "sampler")
    assert listed.cursor.total_count == len(listed.checkpoints)
    assert listed.checkpoints == sorted(listed.checkpoints, key=lambda c: c.time, reverse=True)
    run = rest.get_training_run(client.model_id).result()
    assert (run.last_checkpoint.tinker_path, run.last_sampler_checkpoint.tinker_path, run.lora_rank) == \
        (state, sampler, 8)
    info = client.get_info()
    assert (info.model_id, info.lora_rank, info.is_lora) == (client.model_id, 8, True)
    sessions = rest.list_sessions().result().sessions
    owners = [s for s in sessions if client.model_id in rest.get_session(s).result().training_run_ids]
    assert len(owners) == 1
    with pytest.raises(tinker.NotFoundError, match="Session not found"):
        rest.get_session("session_none").result()


def test_delete_publish_expiry_and_overwrite_are_refused_in_one_line_naming_the_txflow_command(cluster, saved):
    import httpx
    import tinker

    _, handle, _ = cluster
    client, state, sampler, rest = saved
    refusals = {
        "txflow prune ROOT": lambda: rest.delete_checkpoint_from_tinker_path(state).result(),
        "--promote-as NAME": lambda: rest.publish_checkpoint_from_tinker_path(sampler).result(),
        "--older-than DAYS": lambda: rest.set_checkpoint_ttl_from_tinker_path(state, 3600).result(),
    }
    for names, call in refusals.items():
        with pytest.raises(tinker.BadRequestError) as refused:
            call()
        assert names in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(tinker.BadRequestError, match="promote-as"):
        rest.unpublish_checkpoint_from_tinker_path(sampler).result()
    with pytest.raises(tinker.BadRequestError, match="--older-than DAYS"):
        wait(handle, client.save_state("with-ttl", ttl_seconds=60))
    with pytest.raises(tinker.BadRequestError, match="--older-than DAYS"):
        wait(handle, client.save_weights_for_sampler("with-ttl", ttl_seconds=3600))
    # A name saved before: refused in one line at once (upstream answered 500 on SQLite, which the SDK retries,
    # as it retries a 409).
    for save in (client.save_state, client.save_weights_for_sampler):
        with pytest.raises(tinker.BadRequestError, match="save under a new name"):
            wait(handle, save(layout.parse_tinker_path(state if save == client.save_state else sampler)[2]))
    # Nothing was deleted: the state still loads.
    wait(handle, client.load_state(state))
    # SDKs from 0.25 send `overwrite` with save_state.
    answer = httpx.post(f"{handle.cluster.base_url}/api/v1/save_weights", timeout=30,
                        headers={"X-API-Key": handle.cluster.api_key.get_secret_value()},
                        json={"model_id": client.model_id, "path": "rest-state", "overwrite": True})
    assert answer.status_code == 400 and "save under a new name" in answer.json()["detail"]


# --- every public method and CLI command of three SDKs: the compatibility table ------------------------

COMPAT_DOC = Path(__file__).parents[1] / "docs" / "tinker-compatibility.md"
WRITE_TABLE = "TXFLOW_WRITE_COMPAT_TABLE"
REGENERATE = f"{WRITE_TABLE}=1 pytest tests/test_tinker_semantics_e2e.py -k compatibility"
PROBE = Path(__file__).parent / "clients" / "compat_probe.py"
# What a refusal must never be: an answer the user cannot act on.
BARE = {"Not Found", "Method Not Allowed", "Internal Server Error", "Resource not found"}


@pytest.fixture(scope="module")
def compatibility(cluster):
    """One JSON line per public method and CLI command of each SDK, from tests/clients/compat_probe.py run in each
    SDK's environment; the three run at once against the module's cluster."""
    import json
    import os
    import subprocess

    from tests.sdk_envs import SDK_VERSIONS, sdk_env

    _, handle, _ = cluster
    env = {**os.environ, "TINKER_API_KEY": handle.cluster.api_key.get_secret_value(), "TINKER_TELEMETRY": "0"}
    env.pop("PYTHONPATH", None)  # the SDK environment's packages only
    pythons = {version: sdk_env(version) / "bin" / "python" for version in SDK_VERSIONS}
    probes = {version: subprocess.Popen([str(python), str(PROBE), "--base-url", handle.cluster.base_url,
                                         "--model-name", handle.cluster.base_model_path],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for version, python in pythons.items()}
    rows = {}
    try:
        for version, process in probes.items():
            out, err = process.communicate(timeout=600)
            assert process.returncode == 0, f"the {version} probe failed:\n{err[-3000:]}"
            rows[version] = [json.loads(line) for line in out.splitlines()]
    finally:
        for process in probes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return rows


def test_compatibility_every_method_and_command_of_each_sdk_works_or_is_refused_in_one_line(compatibility):
    from tests.sdk_envs import SDK_VERSIONS

    assert list(compatibility) == list(SDK_VERSIONS)
    for version, rows in compatibility.items():
        assert {row["sdk"] for row in rows} == {version}
        # A method or command this probe does not know (a newer SDK's) fails here until it has a probe.
        unprobed = [f"{r['class']}.{r['name']}" for r in rows if r["result"] == "unprobed"]
        assert not unprobed, f"tinker {version}: no probe in tests/clients/compat_probe.py for {unprobed}"
        broken = [f"{r['class']}.{r['name']}: {r['detail']}" for r in rows if r["result"] == "broken"]
        assert not broken, f"tinker {version}:\n" + "\n".join(broken)
        for row in rows:
            assert row["result"] in {"works", "refused", "not applicable"}, row
            assert row["detail"] and "\n" not in row["detail"], row
            if row["result"] == "refused":
                assert row["detail"].split(": ")[-1] not in BARE, row
    # What the probe found is what the SDKs have: a few methods and commands known to be there.
    names = {version: {(r["class"], r["name"]) for r in rows} for version, rows in compatibility.items()}
    assert ("RestClient", "list_user_checkpoints_async") in names["0.13.1"]
    assert ("ServiceClient", "create_custom_loss") in names["0.38.0"]
    assert ("tinker", "checkpoint download") in names["0.13.1"] and ("tinker", "auth whoami") in names["0.38.0"]


def test_compatibility_the_tinker_cli_of_sdk_0_38_against_the_cluster(compatibility):
    """As compat_probe.py measured it with 0.38's CLI: each command's outcome (the probe checks each one:
    the run and its checkpoints listed, the checkpoint still listed after a refused delete, downloaded files)."""
    by_command = {r["name"]: r for r in compatibility["0.38.0"] if r["kind"] == "command"}
    assert {"run list", "run info", "checkpoint list", "checkpoint info", "checkpoint download",
            "checkpoint delete", "version", "model list", "auth status"} <= set(by_command)
    for works in ("run list", "run info", "checkpoint list", "checkpoint info", "version", "model list",
                  "auth status", "checkpoint download"):
        assert by_command[works]["result"] == "works", by_command[works]
    # 0.38 downloads a training checkpoint through external weights (a new client from the state, an export,
    # its signed files, the export deleted): the adapter's files.
    assert by_command["checkpoint download"]["detail"] == "the state checkpoint's PEFT adapter files"
    assert by_command["checkpoint delete"]["result"] == "refused"
    assert "txflow prune ROOT" in by_command["checkpoint delete"]["detail"]
    for refused, names in {"checkpoint publish": "--promote-as NAME", "checkpoint set-ttl": "--older-than DAYS",
                           "billing usage": "billing is not served", "session export-trace": "logs/"}.items():
        assert by_command[refused]["result"] == "refused" and names in by_command[refused]["detail"], refused
    # 0.13's CLI downloads a sampler checkpoint's archive.
    download = next(r for r in compatibility["0.13.1"] if r["name"] == "checkpoint download")
    assert (download["result"], download["detail"]) == ("works", "the sampler checkpoint's PEFT adapter files")


def render_compatibility(compatibility) -> str:
    """The table as docs/tinker-compatibility.md holds it."""
    versions = list(compatibility)
    short = {"works": "works", "refused": "refused", "not applicable": "n/a", "broken": "BROKEN",
             "unprobed": "UNPROBED"}
    lines = ["# Tinker SDK compatibility of a txflow cluster", "",
             "<!-- Written by tests/test_tinker_semantics_e2e.py; do not edit. Regenerate with:", f"     {REGENERATE}",
             "-->", "",
             "Every public method of `ServiceClient`, `TrainingClient`, `SamplingClient` and `RestClient`, and every",
             "command of the `tinker` CLI, of each SDK, called by `tests/clients/compat_probe.py` against one",
             "txflow cluster (SkyRL-tx 0.3.0 with txflow's adapter, the tiny model). The methods and commands are",
             "found by introspection, so one a newer SDK adds fails the test until it has a probe. Each result is",
             "checked for its meaning: *works* says what was checked; *refused* is the message the user reads",
             "(`<run>`, `<path>` stand for ids); *n/a* is a client-side method or one about Tinker's hosted",
             "service, not called; `-` is a method that SDK does not have. An `_async` method is called too,",
             "through the same probe as its twin.", "",
             "| SDK | works | refused | n/a | total |", "| --- | --- | --- | --- | --- |"]
    for version in versions:
        counts = [sum(r["result"] == result for r in compatibility[version]) for result in list(short)[:3]]
        lines.append(f"| `tinker=={version}` | {' | '.join(map(str, counts))} | {len(compatibility[version])} |")
    sections = [("ServiceClient", "method"), ("TrainingClient", "method"), ("SamplingClient", "method"),
                ("RestClient", "method"), ("tinker", "command")]
    for owner, kind in sections:
        lines += ["", f"## {'The `tinker` CLI' if kind == 'command' else '`' + owner + '`'}", "",
                  f"| {kind} | {' | '.join(versions)} | checked, or the message |",
                  "| --- | " + " | ".join("---" for _ in versions) + " | --- |"]
        rows = {v: {r["name"]: r for r in compatibility[v] if r["class"] == owner} for v in versions}
        for name in sorted(set().union(*rows.values())):
            cells = [short[rows[v][name]["result"]] if name in rows[v] else "-" for v in versions]
            details: dict[str, list[str]] = {}
            for v in versions:
                if name in rows[v]:
                    # `<run>` and `<name>` would be read as HTML tags and dropped from the docs site.
                    detail_text = rows[v][name]["detail"].replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
                    details.setdefault(detail_text, []).append(v)
            if len(details) == 1:
                detail = next(iter(details))
            else:
                detail = "; ".join(f"{', '.join(vs)}: {d}" for d, vs in details.items())
            lines.append(f"| `{name}` | {' | '.join(cells)} | {detail} |")
    return "\n".join(lines) + "\n"


def test_compatibility_the_committed_table_is_the_measured_one(compatibility):
    import difflib
    import os

    measured = render_compatibility(compatibility)
    if os.environ.get(WRITE_TABLE) == "1":
        COMPAT_DOC.parent.mkdir(exist_ok=True)
        COMPAT_DOC.write_text(measured)
    committed = COMPAT_DOC.read_text() if COMPAT_DOC.exists() else ""
    diff = "".join(difflib.unified_diff(committed.splitlines(True), measured.splitlines(True),
                                        "docs/tinker-compatibility.md (committed)", "measured"))
    assert committed == measured, (f"docs/tinker-compatibility.md is not what the tests measured; if the change "
                                   f"is intended, regenerate it with `{REGENERATE}` and commit it:\n{diff}")
