"""Tinker calls that do what Tinker documents (issue 32), driven by the tinker 0.13.1 SDK of this
environment against one real 1-process cluster on the tiny model: load_state against
load_state_with_optimizer (adapter point 16), the sampler path and its use (17), weights_info and the
client recreated from it (14), and the sampling parameters the SDK's types allow."""

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
    cfg = RunConfig(processes=1, lora_adapters=16, run_id="semantics", state_dir=str(tmp / "state"),
                    checkpoints=str(tmp / "ckpt")).resolved()
    handle = provision_coordinator.fn(cfg, LocalLauncher())
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
    # One per prompt token, None at position 0 (adapter point 19); then each token's own logprob, the one the
    # training client computes for it as a target.
    tokens = PROMPT.to_ints()
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    targets = wait(handle, training.forward([datum], "cross_entropy")).loss_fn_outputs[0]["logprobs"].tolist()
    assert len(served) == len(tokens) and served[0] is None
    assert served[1:] == pytest.approx(targets, abs=1e-4)
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs: not served by this cluster") as refused:
        wait(handle, sampling.sample(PROMPT, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=3))
    assert "\n" not in str(refused.value)
