"""The `packed-prefixes` change: the rows of a micro-batch that share a prompt are computed once, packed in one row,
and the engine's forward_backward and forward give what upstream's programs give (logprobs, losses and gradients, in
float32). The plan on its own, then upstream's JAX backend in this process on the tiny model."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tx.models import llama3, qwen3
from tx.tinker import types
from tx.tinker.backends import jax as backend
from tx.tinker.backends.utils import pad_batch

from txflow.config import TINY_MODEL
from txflow.upstream.skyrl_tx import packing
from txflow.upstream.tiny_model import resolve_base_model

PROMPT_A, PROMPT_B = np.arange(1, 21), np.arange(100, 120)


def test_rows_that_share_a_prompt_are_packed_and_each_sees_the_prompt_and_its_own_tokens_only():
    rows = [np.r_[PROMPT_A, 7, 8], np.r_[PROMPT_B, 5, 6, 7], np.r_[PROMPT_A, 9], np.r_[PROMPT_B, 1]]
    plan = packing.plan_for(rows, [1, 1, 1, 1], 32)
    assert plan.rows == 2 and list(plan.adapters) == [1, 1]
    assert list(plan.ids[0, :23]) == [*PROMPT_A, 7, 8, 9]  # the prompt once, then each row's own tokens
    assert list(plan.positions[0, :23]) == [*range(22), 20]  # row 2's token continues the prompt, as in its row
    mask = plan.mask[0]
    assert mask[22, :20].all() and not mask[22, 20:22].any() and mask[22, 22]  # the prompt and itself, not row 0's
    assert mask[21, :22].all() and not mask[21, 22:].any()  # row 0's second token: the prompt and row 0's first
    assert not mask[4, 5] and not mask[:23, 23:].any()  # causal, and nothing reads the padding
    for i, row in enumerate(rows):  # every original position is found again, with its token
        assert list(plan.ids[plan.source_rows[i], plan.source_columns[i, :len(row)]]) == list(row)
        assert list(plan.positions[plan.source_rows[i], plan.source_columns[i, :len(row)]]) == list(range(len(row)))


def test_what_rows_share_at_any_depth_is_computed_once_and_each_row_sees_its_own_path_only():
    # A few-shot prefix that every prompt starts with, two prompts after it, two samples of each: one packed row, a
    # prefix tree (the nightly RL step's shape: 8 prompts x 4 samples of SmolLM2's arithmetic task are one row of 384,
    # 32 of 96 unpacked).
    shots, a, b = np.arange(1, 21), [30, 31, 32], [40, 41]
    rows = [np.r_[shots, a, 7, 8], np.r_[shots, b, 5], np.r_[shots, a, 9], np.r_[shots, b, 6, 6]]
    plan = packing.plan_for(rows, [3] * 4, 32)
    assert (plan.rows, plan.length, list(plan.adapters)) == (1, 32, [3])  # 20 + 3 + 2 + 2 + 1 + 1 + 2 = 31 tokens
    assert list(plan.ids[0, :31]) == [*shots, *a, 7, 8, *b, 5, 9, 6, 6]  # each token once, in the order added
    assert list(plan.positions[0, :31]) == [*range(25), 20, 21, 22, 23, 22, 23]  # each its depth in its row
    def seen(node):
        return set(np.nonzero(plan.mask[0, node])[0].tolist())
    shot_nodes = set(range(20))
    assert seen(27) == shot_nodes | {25, 26, 27}  # row 1's 5: the shots, b and itself, not a
    assert seen(28) == shot_nodes | {20, 21, 22, 28}  # row 2's 9: the shots and a, not row 0's own 7 and 8
    assert seen(30) == shot_nodes | {25, 26, 29, 30}  # row 3's last 6: its path only
    assert seen(31) == {31} and not plan.mask[0, :31, 31].any()  # the padding sees itself; nothing reads it
    for i, row in enumerate(rows):  # every original position is found again, with its token and position
        assert list(plan.ids[plan.source_rows[i], plan.source_columns[i, :len(row)]]) == list(row)
        assert list(plan.positions[plan.source_rows[i], plan.source_columns[i, :len(row)]]) == list(range(len(row)))
    # The head's logprobs: each distinct (packed position, target) once. The targets are the next tokens (the last
    # one wraps round, as `model_pass` builds them), so a shared prefix asks once: 30 edges of the tree, each row's
    # last token, and the padding (column 0, target 0): 35 queries, in a bucket of 48, instead of 4 x 32 positions.
    targets = pad_batch([[*row[1:], row[0]] for row in rows], 32, np.int32)
    queries = packing.queries_for(plan, targets)
    assert (len(np.unique(queries.inverse)), queries.count, list(set(queries.adapters))) == (35, 48, [3])
    for i, row in enumerate(rows):  # every original position reads its own position's logprob of its own target
        asked = queries.inverse[i, :len(row)]
        assert list(queries.nodes[asked]) == list(plan.source_columns[i, :len(row)])
        assert list(queries.targets[asked]) == list(targets[i, :len(row)])
    # A sample reads its prompt's nodes, whichever row added them.
    rows = [np.r_[shots, a, 1], np.r_[shots, b, 2], np.r_[shots, b, 3]]
    plan = packing.plan_for(rows, [0] * 3, 64)
    assert list(plan.source_columns[2, :22]) == list(plan.source_columns[1, :22]) == [*range(20), 24, 25]


def test_what_packing_would_not_halve_is_left_to_upstreams_program():
    assert packing.plan_for([PROMPT_A + 100 * i for i in range(4)], [0] * 4, 32) is None  # nothing shared
    assert packing.plan_for([np.r_[PROMPT_A[:packing.MIN_SHARED - 1], i] for i in range(4)], [0] * 4, 32) is None
    assert packing.plan_for([np.r_[PROMPT_A, i] for i in range(4)], [0, 1, 2, 3], 32) is None  # one adapter each
    rows = [np.r_[PROMPT_A, [i] * 10] for i in range(4)]  # 30 tokens each, padded to 32: packed, 20 + 4 x 10
    plan = packing.plan_for(rows, [0] * 4, 32)
    assert (plan.rows, plan.length) == (1, 64)  # 64 tokens computed instead of 128
    assert packing.plan_for(rows[:2], [0] * 2, 32) is None  # 40 tokens in a bucket of 64 instead of 2 x 32


def prompted_rows(prompts: int, samples: int, own: int, shots: int = 0) -> list[list[int]]:
    """`samples` rows of `own` tokens after each of `prompts` prompts of 30 tokens, whose first `shots` tokens are
    the same for every prompt (a few-shot prefix)."""
    rng = np.random.default_rng(0)
    prefix = list(rng.integers(1, 200, shots))
    return [[*prefix, *prompt, *rng.integers(1, 200, own)]
            for prompt in (rng.integers(1, 200, 30 - shots) for _ in range(prompts)) for _ in range(samples)]


def model_pass(rows: list[list[int]], loss: str):
    n = len(rows)
    return types.PreparedModelPassBatch(
        all_input_ids=rows, all_targets=[r[1:] + [r[0]] for r in rows],
        all_token_weights=[[0.0] * (len(r) - 3) + [1.0] * 3 for r in rows],
        all_sampling_logprobs=[[-2.0] * len(r) for r in rows], all_advantages=[[0.5 - i % 2] * len(r) for i, r in
                                                                               enumerate(rows)],
        all_model_ids=["m"] * n, all_loss_fn_types=[types.LOSS_TYPES[loss]] * n, all_loss_fn_configs=[None] * n,
        request_batch_slices=[("r", "m", 0, n)])


@pytest.fixture
def engine(monkeypatch):
    """Upstream's backend with `packed-prefixes` only (each patched name upstream's again after the test), the tiny
    model in float32, an adapter whose B is not zero (one optimizer step), so both LoRA factors get gradients; with
    a LoRA on the output head too (the SDKs' default `train_unembed`), which the head's queries read by adapter."""
    monkeypatch.setattr(backend.JaxBackendImpl, "_create_loss_and_grad_fn",
                        getattr(backend.JaxBackendImpl._create_loss_and_grad_fn, "upstream",
                                backend.JaxBackendImpl._create_loss_and_grad_fn))
    for name in ("_model_pass", "_micro_batch_size"):  # upstream's again after the test, whatever wrapped them
        monkeypatch.setattr(backend.JaxBackendImpl, name, getattr(backend.JaxBackendImpl, name))
    for module in (llama3, qwen3):
        monkeypatch.setattr(module, "dot_product_attention",
                            getattr(module.dot_product_attention, "upstream", module.dot_product_attention))
    packing.model_passes_pack_shared_prefixes()
    impl = backend.JaxBackendImpl(resolve_base_model(TINY_MODEL), backend.JaxBackendConfig(
        max_lora_adapters=2, max_lora_rank=4, train_micro_batch_size=8))
    impl.create_model("m", types.LoraConfig(rank=4, alpha=8.0, seed=0, train_unembed=True))
    impl.forward_backward(model_pass(prompted_rows(2, 4, 5), "importance_sampling"))  # the test's shapes
    impl.optim_step("m", types.OptimStepInput(adam_params=types.AdamParams(
        learning_rate=0.05, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)))
    return impl


def figures(impl, batch, packed: bool, monkeypatch) -> dict:
    calls, micro_batches = [], []
    with monkeypatch.context() as patch:
        patch.setattr(packing, "packs", lambda engine: (calls.append(packed), packed)[1])
        plan = packing.micro_batch_plan
        patch.setattr(packing, "micro_batch_plan", lambda ids, *rest: (micro_batches.append(len(ids)),
                                                                       plan(ids, *rest))[1])
        impl.accumulated_grads = backend.AccumulatedGradients.create(impl.lora_params, impl.config.max_lora_adapters)
        outputs = impl.forward_backward(batch)["r"].loss_fn_outputs
        forward = impl.forward(batch)["r"].loss_fn_outputs
    assert calls and set(calls) == {packed}
    return {"logprobs": [o["logprobs"]["data"] for o in outputs], "losses": [o["elementwise_loss"]["data"]
                                                                             for o in outputs],
            "forward": [o["logprobs"]["data"] for o in forward],
            "grads": [np.asarray(g) for g in jax.tree.leaves(impl.accumulated_grads.grad_sum)],
            "counts": np.asarray(impl.accumulated_grads.counts), "micro_batches": micro_batches}


def test_a_packed_micro_batch_gives_upstreams_logprobs_losses_and_gradients(engine, monkeypatch):
    # 4 prompts of 30 tokens that start with the same 20 x 4 samples of 5 tokens (an RL step's shape, with a few-shot
    # prefix): one packed row of 192 (20 + 4 x 10 + 16 x 5 = 140 tokens) instead of 16 of 48. That is one micro-batch
    # where upstream runs two of 8 rows (`train_micro_batch_size`): packed, it computes less than one of them.
    batch = model_pass(prompted_rows(4, 4, 5, shots=20), "importance_sampling")
    plan = packing.plan_for([np.asarray(r) for r in batch.all_input_ids], [1] * 16, 48)
    assert (plan.rows, plan.length) == (1, 192) and packing.whole_batch_packs(engine, batch)
    packed, upstream = figures(engine, batch, True, monkeypatch), figures(engine, batch, False, monkeypatch)
    assert packed["micro_batches"] == [16, 16]  # forward_backward's and forward's, each the whole batch
    for key in ("logprobs", "losses", "forward"):
        for got, want in zip(packed[key], upstream[key], strict=True):
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    assert sum(np.abs(g).sum() > 0 for g in upstream["grads"]) > 0
    for got, want in zip(packed["grads"], upstream["grads"], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(want).max())))
    assert list(packed["counts"]) == list(upstream["counts"])


def test_a_packed_program_is_logged_the_first_time_its_shape_comes(engine, monkeypatch):
    # `compile-log` names each program the first time its shape comes: a packed micro-batch is a program of its own,
    # beside upstream's for the same rows and length.
    import logging
    import re

    from tx.utils.generator import GeneratorMixin
    from tx.utils.log import logger

    from txflow.upstream.skyrl_tx import ranks

    for owner, name in ((backend.JaxBackendImpl, "_model_pass"), (backend.JaxBackendImpl, "_jit_timing_context"),
                        (GeneratorMixin, "generate")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # upstream's again after the test
    ranks.every_program_compile_logged()
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    try:
        def compiles(rows) -> list[str]:
            engine.forward(model_pass(rows, "importance_sampling"))
            found = [f"{m[1]} {m[2]}" for line in lines
                     if (m := re.match(r"JIT compiling for (\w+) seq_len=(\d+)", line))]
            lines.clear()
            return found

        shared = prompted_rows(2, 4, 5)  # packed: 2 rows of 64
        unshared = [list(np.random.default_rng(i).integers(1, 200, 35)) for i in range(8)]
        assert compiles(shared) == ["forward 48"]
        assert compiles(shared) == []
        assert compiles(unshared) == ["forward 48"]  # the same rows and length, upstream's program
        assert compiles(unshared) == []
    finally:
        logger.removeHandler(handler)
