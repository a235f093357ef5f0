"""The `compile-log` change: every program the engine compiles is logged under what it computes, the first time
its shape comes and never again, so that the run's compile watch (`txflow.cluster.compiles`) names each one. Upstream's
JAX backend, in this process, on the tiny model."""

from __future__ import annotations

import logging
import re

import pytest
from tx.tinker import types
from tx.tinker.backends import jax as backend
from tx.utils.log import logger

from txflow.config import TINY_MODEL
from txflow.upstream.skyrl_tx import ranks
from txflow.upstream.tiny_model import resolve_base_model

pytestmark = [pytest.mark.together]


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def compiles(self) -> list[str]:
        """`forward 32`, ... for each program announced since the last call."""
        found = [f"{m[1]} {m[2]}" for line in self.lines if (m := re.match(r"JIT compiling for (\w+) seq_len=(\d+)",
                                                                           line))]
        self.lines.clear()
        return found


def model_pass(rows: int, length: int):
    ids = [[(5 * i + j) % 200 + 1 for j in range(length)] for i in range(rows)]
    return types.PreparedModelPassBatch(
        all_input_ids=ids, all_targets=[r[1:] + [r[0]] for r in ids], all_token_weights=[[1.0] * length] * rows,
        all_sampling_logprobs=[[0.0] * length] * rows, all_advantages=[[0.0] * length] * rows,
        all_model_ids=["m"] * rows, all_loss_fn_types=[types.LOSS_TYPES["cross_entropy"]] * rows,
        all_loss_fn_configs=[None] * rows, request_batch_slices=[("r", "m", 0, rows)])


def sample_batch(max_tokens: int, prompt_logprobs: bool):
    params = types.SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)
    return types.PreparedSampleBatch(
        all_prompts=[[3, 4, 5, 6]], all_sampling_params=[params], all_model_ids=[""], all_checkpoint_ids=[""],
        all_checkpoint_paths=[""], needs_prompt_logprobs=prompt_logprobs,
        request_batch_slices=[("s", "", 0, 1, prompt_logprobs)])


def test_each_program_is_logged_under_what_it_computes_the_first_time_its_shape_comes(monkeypatch):
    from tx.utils.generator import GeneratorMixin

    for owner, name in ((backend.JaxBackendImpl, "_model_pass"), (backend.JaxBackendImpl, "_jit_timing_context"),
                        (GeneratorMixin, "generate")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # upstream's again after the test
    ranks.every_program_compile_logged()
    impl = backend.JaxBackendImpl(resolve_base_model(TINY_MODEL), backend.JaxBackendConfig(
        max_lora_adapters=2, max_lora_rank=4, train_micro_batch_size=4, sample_max_num_sequences=1))
    impl.create_model("m", types.LoraConfig(rank=4, alpha=8.0, seed=0))
    lines = Lines()
    logger.addHandler(lines)
    try:
        impl.forward_backward(model_pass(4, 20))
        assert lines.compiles() == ["train 32"]
        impl.forward(model_pass(4, 20))  # upstream: the same length, so not logged
        assert lines.compiles() == ["forward 32"]
        impl.forward_backward(model_pass(4, 30))  # the same bucket and rows: the program is compiled
        impl.forward(model_pass(4, 20))
        assert lines.compiles() == []
        impl.forward_backward(model_pass(6, 20))  # a micro-batch of 2 rows after one of 4: a program of its own
        assert lines.compiles() == ["train 32"]
        impl.sample(sample_batch(4, prompt_logprobs=False))
        assert lines.compiles() == ["sample 32"]
        impl.sample(sample_batch(4, prompt_logprobs=True))  # upstream: the same length, so not logged
        impl.sample(sample_batch(6, prompt_logprobs=True))
        impl.sample(sample_batch(6, prompt_logprobs=True))
        assert lines.compiles() == ["sample 32", "sample 32"]
    finally:
        logger.removeHandler(lines)
    # Upstream's metrics keep their figure per length.
    assert set(impl.metrics.train_seq_len_jit_times) == {32} and set(impl.metrics.sample_seq_len_jit_times) == {32}


def test_the_end_of_a_compile_says_how_much_of_it_the_persistent_cache_held(monkeypatch, tmp_path):
    """The end line says how much of the call went to making the program (tracing, lowering, compiling or loading:
    the report's compile seconds), counts the program's executables that JAX's persistent cache held, and what
    compiling them had taken: the run then says "loaded from this machine's cache" rather than "compiled"
    (`txflow.cluster.compiles`)."""
    import jax
    from jax._src import compilation_cache
    from tx.utils.generator import GeneratorMixin

    for owner, name in ((backend.JaxBackendImpl, "_model_pass"), (backend.JaxBackendImpl, "_jit_timing_context"),
                        (GeneratorMixin, "generate")):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    previous = {key: getattr(jax.config, key) for key in ("jax_compilation_cache_dir",
                                                           "jax_persistent_cache_min_compile_time_secs")}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    ranks.every_program_compile_logged()
    lines = Lines()
    logger.addHandler(lines)
    try:
        impl = backend.JaxBackendImpl(resolve_base_model(TINY_MODEL), backend.JaxBackendConfig(
            max_lora_adapters=2, max_lora_rank=4, train_micro_batch_size=4, sample_max_num_sequences=1))
        impl.create_model("m", types.LoraConfig(rank=4, alpha=8.0, seed=0))
        ends = []
        for _ in range(2):  # an empty cache, then the same program in a process that has not compiled it
            lines.lines.clear()
            impl.forward_backward(model_pass(4, 20))
            ends += [line for line in lines.lines if line.startswith("JIT compilation for train seq_len=32")]
            jax.clear_caches()
            ranks.COMPILED.clear()
    finally:
        logger.removeHandler(lines)
        for key, value in previous.items():
            jax.config.update(key, value)
        compilation_cache.reset_cache()
    compiled, loaded = (re.search(r"took ([0-9.]+)s \(compiling ([0-9.]+)s; persistent cache: (\d+) of (\d+) loaded, "
                                  r"([0-9.]+)s of compiling saved\)$", end) for end in ends)
    assert compiled and loaded, ends
    assert int(compiled[3]) == 0 < int(compiled[4])  # nothing was in the cache: every executable compiled
    assert int(loaded[3]) == int(loaded[4]) == int(compiled[4]) and float(loaded[5]) > 0  # all of them loaded
    # What went to making the program is part of the call, and loading it takes less than compiling it.
    assert 0 < float(compiled[2]) <= float(compiled[1]) and 0 < float(loaded[2]) < float(compiled[2]), ends
