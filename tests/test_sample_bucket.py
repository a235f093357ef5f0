"""The `sampling-buckets` change: sampling prompts of different lengths share one length bucket, so the engine compiles
one sampling program for a run's readiness sample, held-out prompts and sequences; longer prompts keep upstream's
buckets. The `sampling-rows` change: a call of more rows than upstream's batch, or one that asks for prompt
logprobs, runs in larger batches. Upstream's JAX
backend, in this process, on the tiny model."""

from __future__ import annotations

import pytest
from tx.tinker import types
from tx.tinker.backends import jax as backend

from txflow.config import TINY_MODEL
from txflow.upstream.skyrl_tx import ranks
from txflow.upstream.tiny_model import resolve_base_model


@pytest.fixture
def upstream_sample(monkeypatch):
    monkeypatch.setattr(backend.JaxBackendImpl, "sample", backend.JaxBackendImpl.sample)  # restored after


def sample(impl, prompt_lengths: list[int], prompt_logprobs: bool = False) -> list[list[int]]:
    prompts = [[(7 * i + j) % 200 + 1 for j in range(n)] for i, n in enumerate(prompt_lengths)]
    params = types.SamplingParams(temperature=0.0, max_tokens=4, seed=0)
    batch = types.PreparedSampleBatch(
        all_prompts=prompts, all_sampling_params=[params] * len(prompts), all_model_ids=[""] * len(prompts),
        all_checkpoint_ids=[""] * len(prompts), all_checkpoint_paths=[""] * len(prompts),
        needs_prompt_logprobs=prompt_logprobs, request_batch_slices=[(f"r{i}", "", i, i + 1, prompt_logprobs)
                                                                     for i in range(len(prompts))])
    results = impl.sample(batch)
    return [list(results[f"r{i}"].sequences[0].tokens) for i in range(len(prompts))]


def test_short_prompts_share_one_sampling_program_and_sample_the_same_tokens(upstream_sample):
    config = backend.JaxBackendConfig(max_lora_adapters=2, max_lora_rank=4, sample_max_num_sequences=2)
    impl = backend.JaxBackendImpl(resolve_base_model(TINY_MODEL), config)
    before = [sample(impl, [5]), sample(impl, [40])]
    assert set(impl.metrics.sample_seq_len_jit_times) == {32, 48}  # upstream: a program per bucket
    ranks.sample_prompts_share_a_bucket()
    impl.metrics.sample_seq_len_jit_times.clear()
    after = [sample(impl, [5]), sample(impl, [40]), sample(impl, [70])]
    assert set(impl.metrics.sample_seq_len_jit_times) == {ranks.SAMPLE_BUCKET_FLOOR, 96}
    assert after[:2] == before  # the padding changes no token
    assert backend.round_up_seq_len(10) == 32  # training keeps its buckets


def test_a_call_of_more_rows_than_a_batch_runs_in_larger_batches_and_samples_the_same_tokens(upstream_sample,
                                                                                           monkeypatch):
    from tx.utils.generator import GeneratorMixin

    config = backend.JaxBackendConfig(max_lora_adapters=2, max_lora_rank=4, sample_max_num_sequences=2)
    impl = backend.JaxBackendImpl(resolve_base_model(TINY_MODEL), config)
    rows: list[int] = []
    generate = GeneratorMixin.generate
    monkeypatch.setattr(GeneratorMixin, "generate",
                        lambda model, input_ids, *args, **kwargs: (rows.append(len(input_ids)),
                                                                   generate(model, input_ids, *args, **kwargs))[1])

    def batches(*args, **kwargs) -> tuple[list[list[int]], list[int]]:
        tokens = sample(impl, *args, **kwargs)
        seen = rows[:]
        rows.clear()
        return tokens, seen

    short = [5, 9, 12, 20, 7, 30, 3, 16]
    before, upstream_rows = batches(short)
    assert upstream_rows == [2, 2, 2, 2]
    ranks.sample_prompts_share_a_bucket()
    ranks.sampling_batches_fit_the_call()
    assert batches(short) == (before, [8])  # one batch of 4 x 2 rows, the same greedy tokens
    assert batches(short[:2])[1] == [2]  # a call that fits upstream's batch keeps it
    # A call that asks for prompt logprobs (an evaluation) runs in batches of its own size however few its rows: one
    # program for them all, half the larger batch (an evaluation's sampling is where a rank's memory peaks).
    evaluation = 2 * ranks.EVALUATION_ROWS_FACTOR
    assert evaluation < 8
    assert batches(short, prompt_logprobs=True)[1] == [evaluation] * (8 // evaluation)
    assert batches(short[:1], prompt_logprobs=True)[1] == [evaluation]
    assert batches([100] * 8)[1] == [2, 2, 2, 2]  # rows of 128 + 4 tokens: 4 x as many would hold more positions
    assert config.sample_max_num_sequences == 2  # upstream's again after the call


def test_the_patched_methods_keep_the_annotations_a_broadcast_is_serialised_by(monkeypatch):
    """Rank 0 sends a call to the workers typed by the method's annotations; without them the workers got
    dicts and a 2-rank cluster never answered its readiness sample."""
    from typing import get_type_hints

    for name in ("sample", "optim_step"):
        monkeypatch.setattr(backend.JaxBackendImpl, name, getattr(backend.JaxBackendImpl, name))
    upstream = {name: get_type_hints(getattr(backend.JaxBackendImpl, name)) for name in ("sample", "optim_step")}
    ranks.sample_prompts_share_a_bucket()
    ranks.sampling_batches_fit_the_call()
    ranks.optimizer_compile_logged()
    assert {name: get_type_hints(getattr(backend.JaxBackendImpl, name)) for name in upstream} == upstream
    assert get_type_hints(backend.JaxBackendImpl.sample)["prepared_batch"] is types.PreparedSampleBatch
