"""Tinker's losses in txflow's engine (txflow.upstream.skyrl_tx.losses, adapter point 13).

Each loss against a small reference written from Tinker's documented formula, in torch: the loss and
its gradient with respect to the target logprobs, on hand-made tokens where clipping acts and where it
does not. Then the backend itself, in this process on the tiny model: a loss is the sum over tokens and
sequences, so the gradient of forward_backward_custom's second pass (cross_entropy with weights
-dL/dlogprob) is the gradient of the user's loss; a new configuration reaches the compiled program; every
result carries `loss:sum`. The API's refusals are checked on the real app; the SDKs' clients run these
losses end to end in test_sdk_matrix_e2e.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from txflow.upstream.skyrl_tx import losses

# Token 0 is a prompt token (weight 0, sampling logprob 0.0, no advantage), as the SDKs send it.
# Ratios exp(target - sampling) of the sampled tokens: 1.22, 0.67, 1.0, 18.2, 0.99.
TARGET = [-0.7, -1.0, -0.5, -2.0, -0.1, -1.31]
SAMPLING = [0.0, -1.2, -0.1, -2.0, -3.0, -1.3]
ADVANTAGES = [0.0, 1.0, -1.0, 0.5, 2.0, -0.5]
WEIGHTS = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def reference(name: str, config: dict, tlp, w, slp, adv):
    """Tinker's documented objective, token-wise, summed (tinker-docs.thinkingmachines.ai, "Losses")."""
    counted = w != 0
    if name == "cross_entropy":
        return -(tlp * w).sum()
    ratio = torch.exp(tlp - slp)
    if name == "importance_sampling":
        return -(ratio * adv)[counted].sum()
    low, high = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if name == "ppo":
        return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)[counted].sum()
    if name == "cispo":
        return -(torch.clamp(ratio, low, high).detach() * tlp * adv)[counted].sum()
    sampled = counted & ((slp != 0) | (adv != 0))
    if name == "dro":
        return -(tlp * adv)[counted].sum() + (0.5 * config["beta"] * (tlp - slp) ** 2)[sampled].sum()
    if name == "gspo":
        log_ratio = (tlp.detach() - slp)[sampled].mean()
        seq_ratio = torch.exp(log_ratio + tlp - tlp.detach())
        return -torch.minimum(seq_ratio * adv, torch.clamp(seq_ratio, low, high) * adv)[counted].sum()
    raise ValueError(name)


def reference_figures(name, config, target=TARGET):
    tlp = torch.tensor(target, dtype=torch.float64, requires_grad=True)
    inputs = (torch.tensor(x, dtype=torch.float64) for x in (WEIGHTS, SAMPLING, ADVANTAGES))
    loss = reference(name, config, tlp, *inputs)
    loss.backward()
    return float(loss), tlp.grad.numpy()


def engine_figures(name, config, target=TARGET):
    key = losses.resolved(name, config)
    loss = losses.loss_function(key)
    args = [jnp.asarray(x, dtype=jnp.float32) for x in (WEIGHTS, SAMPLING, ADVANTAGES)]
    value, grad = jax.value_and_grad(lambda tlp: loss(tlp, *args).sum())(jnp.asarray(target, dtype=jnp.float32))
    return float(value), np.asarray(grad)


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),  # 0.8-1.2: acts on the tokens of ratio 1.22, 0.67 and 18.2
    ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 20.0}),  # acts on none
    ("cispo", {}),  # 0.0-4.0: acts on the ratio 18.2
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),  # acts on 1.22 and 0.67 too
    ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 100.0}),  # acts on none
    ("dro", {"beta": 0.05}),
    ("dro", {"beta": 2.0}),
    ("gspo", {}),  # the sequence ratio is 2.3: clipped at 1.2
    ("gspo", {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0}),  # not clipped
]


@pytest.mark.parametrize("name, config", CASES, ids=[f"{n}-{c}" for n, c in CASES])
def test_each_loss_and_its_gradient_match_tinkers_definition(name, config):
    config = {**losses.DEFAULTS.get(name, {}), **config}
    value, grad = engine_figures(name, config)
    expected_value, expected_grad = reference_figures(name, config)
    assert value == pytest.approx(expected_value, rel=1e-5, abs=1e-5)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-6)
    assert grad[0] == 0  # the prompt token never counts


@pytest.mark.parametrize("name", ["ppo", "cispo", "gspo"])
def test_clipping_acts_on_these_inputs_and_a_wider_band_lifts_it(name):
    # Else the cases above would not tell clipped from unclipped.
    narrow, wide = engine_figures(name, {}), engine_figures(name, {"clip_low_threshold": 0.01,
                                                                  "clip_high_threshold": 100.0})
    assert not np.allclose(narrow[1], wide[1])


def test_swapped_clip_bounds_and_a_flipped_sign_would_not_match():
    # What the comparison catches: ppo with its bounds swapped, importance sampling with its sign flipped.
    swapped = engine_figures("ppo", {"clip_low_threshold": 1.2, "clip_high_threshold": 0.8})
    assert not np.allclose(swapped[1], reference_figures("ppo", {"clip_low_threshold": 0.8,
                                                                "clip_high_threshold": 1.2})[1])
    flipped = -engine_figures("importance_sampling", {})[0]
    assert flipped != pytest.approx(reference_figures("importance_sampling", {})[0])


@pytest.mark.parametrize("loss_fn, config, expected", [
    ("stable_reinforce", None, "the Tinker cookbook takes loss_fn=importance_sampling"),
    ("bogus", None, "this cluster serves cross_entropy, importance_sampling, ppo, cispo, dro, gspo"),
    ("ppo", {"clip_epsilon": 0.2}, "'clip_epsilon' does not apply to ppo, which takes clip_low_threshold"),
    ("importance_sampling", {"beta": 1.0}, "takes no loss_fn_config"),
    ("dro", None, "needs loss_fn_config={'beta': ...}"),
    ("cispo", {"clip_low_threshold": 1.5}, "0 <= clip_low_threshold <= 1 <= clip_high_threshold"),
    ("ppo", {"clip_low_threshold": "0.8"}, "takes numbers"),
])
def test_what_cannot_be_served_is_refused_with_one_line(loss_fn, config, expected):
    reason = losses.problem(loss_fn, config)
    assert reason is not None and expected in reason and "\n" not in reason


def test_what_can_be_served_passes():
    assert all(losses.problem(name, None) is None for name in losses.SERVED if name != "dro")
    assert losses.problem("dro", {"beta": 0.1}) is None
    assert losses.problem("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 5.0}) is None


def bf16_confident_logprob() -> float:
    """What SkyRL-tx's sampler gives a token of p ~ 0.98 on a bfloat16 model: exactly 0.0 (its
    logits_to_logprobs on bfloat16 logits)."""
    from tx.utils.logits_processor import LogitsProcessorMixin

    logits = jnp.asarray([[20.0, 16.0, 15.0, 12.0]], dtype=jnp.bfloat16)  # p(token 0) = 0.975 in float32
    return float(LogitsProcessorMixin.logits_to_logprobs(logits, jnp.asarray([0]))[0])


@pytest.mark.parametrize("name, config", [("gspo", {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0}),
                                          ("gspo", {}), ("dro", {"beta": 2.0})])
def test_a_confident_token_of_a_bf16_sampler_counts_as_sampled(name, config):
    # Token 3 was sampled with p ~ 0.98 on a bfloat16 model: its sampling logprob is exactly 0.0, like a prompt
    # token's; its advantage says it was sampled. Tinker's objective runs over it (gspo's ratio, dro's penalty).
    assert bf16_confident_logprob() == 0.0
    sampling = list(SAMPLING)
    sampling[3] = bf16_confident_logprob()
    target = list(TARGET)
    target[3] = -0.4
    config = {**losses.DEFAULTS.get(name, {}), **config}
    key = losses.resolved(name, config)
    args = [jnp.asarray(x, dtype=jnp.float32) for x in (WEIGHTS, sampling, ADVANTAGES)]
    value, grad = jax.value_and_grad(lambda tlp: losses.loss_function(key)(tlp, *args).sum())(
        jnp.asarray(target, dtype=jnp.float32))
    tlp = torch.tensor(target, dtype=torch.float64, requires_grad=True)
    expected = reference(name, config, tlp, *(torch.tensor(x, dtype=torch.float64)
                                              for x in (WEIGHTS, sampling, ADVANTAGES)))
    expected.backward()
    assert float(value) == pytest.approx(float(expected), rel=1e-5, abs=1e-5)
    np.testing.assert_allclose(np.asarray(grad), tlp.grad.numpy(), rtol=1e-5, atol=1e-6)
    # Read as a prompt token (the logprob alone), the same inputs give another loss.
    prompt_like = [w != 0 and lp != 0 for w, lp in zip(WEIGHTS, sampling)]
    assert prompt_like[3] is False and losses.sampled_tokens(WEIGHTS, sampling, ADVANTAGES)[3] is True


def test_a_gspo_sequence_ratio_mask_must_mark_the_sampled_tokens():
    inputs = {"target_tokens": [1, 2, 3], "weights": [0.0, 1.0, 1.0], "logprobs": [0.0, -1.0, -2.0]}
    assert losses.datum_problem("gspo", {**inputs, "sequence_ratio_mask": [0, 1, 1]}) is None
    # A bfloat16 sampler's confident token (logprob exactly 0.0) with its advantage is a sampled token.
    confident = {**inputs, "logprobs": [0.0, -1.0, 0.0], "advantages": [0.0, 0.5, 0.5]}
    assert losses.datum_problem("gspo", {**confident, "sequence_ratio_mask": [0, 1, 1]}) is None
    assert "must mark exactly the sampled tokens" in losses.datum_problem("gspo", {**inputs,
                                                                                 "sequence_ratio_mask": [1, 1, 1]})
    assert losses.datum_problem("ppo", {**inputs, "sequence_ratio_mask": [1, 1, 1]}) is None


# --- the backend ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend():
    """SkyRL-tx's backend in this process on the tiny model, with the losses installed; restored afterwards."""
    from tx.tinker import loss_fns, types
    from tx.tinker.backends import jax as upstream
    from tx.tinker.backends.jax import JaxBackendConfig, JaxBackendImpl

    from txflow.upstream.tiny_model import resolve_base_model

    saved = (dict(types.LOSS_TYPES), list(loss_fns.LOSS_FUNCTIONS), upstream.AccumulatedGradients.get_mean,
             JaxBackendImpl._model_pass, types.ForwardBackwardInput.model_fields["loss_fn"].annotation)
    losses.install_backend()
    try:
        impl = JaxBackendImpl(resolve_base_model("tiny"), JaxBackendConfig(max_lora_adapters=2, max_lora_rank=8))
        impl.create_model("m", types.LoraConfig(rank=8, alpha=32.0, seed=3))
        yield impl
    finally:
        types.LOSS_TYPES.clear()
        types.LOSS_TYPES.update(saved[0])
        loss_fns.LOSS_FUNCTIONS[:] = saved[1]
        upstream.AccumulatedGradients.get_mean, JaxBackendImpl._model_pass = saved[2], saved[3]
        types.ForwardBackwardInput.model_fields["loss_fn"].annotation = saved[4]
        types.ForwardBackwardInput.model_rebuild(force=True)


SEQUENCES = [[5, 17, 33, 80, 120, 7, 9], [3, 44, 61, 2, 250]]


def batch(loss_fn: str, weights, config=None, advantages=None, logprobs=None):
    from tx.tinker import types

    n = len(SEQUENCES)
    return types.PreparedModelPassBatch(
        all_input_ids=[s[:-1] for s in SEQUENCES], all_targets=[s[1:] for s in SEQUENCES],
        all_token_weights=weights, all_sampling_logprobs=logprobs or [[0.0] * (len(s) - 1) for s in SEQUENCES],
        all_advantages=advantages or [[0.0] * (len(s) - 1) for s in SEQUENCES], all_model_ids=["m"] * n,
        all_loss_fn_types=[losses.SERVED.index(loss_fn)] * n, all_loss_fn_configs=[config] * n,
        request_batch_slices=[("r1", "m", 0, n)])


def logprobs_of(backend) -> list[list[float]]:
    out = backend.forward(batch("cross_entropy", [[0.0] * (len(s) - 1) for s in SEQUENCES]))["r1"]
    return [o["logprobs"]["data"] for o in out.loss_fn_outputs]


def accumulated(backend) -> list[np.ndarray]:
    index = backend.models["m"].adapter_index
    return [np.asarray(g[index]) for g in jax.tree.leaves(backend.accumulated_grads.get_mean(index))]


def reset(backend) -> None:
    backend.accumulated_grads = backend.accumulated_grads.reset_adapter(backend.models["m"].adapter_index)


def hand_gradient(backend) -> list[np.ndarray]:
    """d/d(LoRA) of sum over both sequences of sum over tokens of logprob^2, through the model itself."""
    from flax import nnx

    index = backend.models["m"].adapter_index

    def loss(lora_params, non_lora_params):
        model = nnx.merge(backend.graphdef, lora_params, non_lora_params)
        total = 0.0
        for sequence in SEQUENCES:
            ids = jnp.asarray([sequence[:-1]], dtype=jnp.int32)
            out = model(ids, attention_mask=jnp.ones_like(ids), adapter_indices=jnp.array([index], dtype=jnp.int32))
            logprobs = model.compute_logprobs(out.last_hidden_state, jnp.asarray([sequence[1:]], dtype=jnp.int32),
                                              jnp.array([index], dtype=jnp.int32))
            total = total + (logprobs ** 2).sum()
        return total

    with jax.set_mesh(backend.mesh):
        # Compiled once: op by op, the gradient of the whole model took a minute.
        grads = jax.jit(jax.grad(loss))(backend.lora_params, backend.non_lora_params)
    return [np.asarray(g[index]) for g in jax.tree.leaves(grads)]


def test_the_second_pass_of_a_custom_loss_applies_the_gradient_of_the_users_loss(backend):
    # forward_backward_custom with loss = sum of squared logprobs: the SDK sends cross_entropy with
    # weights -dL/dlogprob = -2 * logprob (of either sign in general; all positive here).
    lps = logprobs_of(backend)
    reset(backend)
    result = backend.forward_backward(batch("cross_entropy", [[-2.0 * lp for lp in seq] for seq in lps]))["r1"]
    applied, expected = accumulated(backend), hand_gradient(backend)
    assert len(applied) == len(expected) and max(float(np.abs(e).max()) for e in expected) > 1e-3
    for got, want in zip(applied, expected):
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=1e-6)
    # loss:sum is the surrogate's value, sum of -w * logprob = 2 * sum of logprob^2; per-token losses unscaled.
    assert result.metrics["loss:sum"] == pytest.approx(sum(2 * lp * lp for seq in lps for lp in seq), rel=1e-4)
    assert result.loss_fn_outputs[0]["elementwise_loss"]["data"] == pytest.approx([2 * lp * lp for lp in lps[0]],
                                                                                  rel=1e-4)


def test_weights_that_sum_to_zero_give_the_plain_sum_not_a_blow_up(backend):
    # Upstream divides a sequence's loss by the sum of its weights (clamped at 1e-9): 1e9 times too large.
    lps = logprobs_of(backend)
    weights = [[(-1.0) ** i for i in range(len(seq))] for seq in lps]
    weights = [w[:-1] + [-sum(w[:-1])] for w in weights]  # each sums to exactly zero
    reset(backend)
    backend.forward_backward(batch("cross_entropy", weights))
    largest = max(float(np.abs(g).max()) for g in accumulated(backend))
    assert 0 < largest < 100


def test_a_new_configuration_reaches_the_compiled_program(backend):
    lps = logprobs_of(backend)
    sampling = [[lp - 0.5 for lp in seq] for seq in lps]  # ratio exp(0.5) = 1.65 on every token
    advantages = [[1.0] * len(seq) for seq in lps]
    grads = []
    for config in ({"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, {"clip_low_threshold": 0.5,
                                                                            "clip_high_threshold": 2.0}):
        reset(backend)
        backend.forward_backward(batch("ppo", [[1.0] * len(s) for s in lps], config, advantages, sampling))
        grads.append(accumulated(backend))
    # Clipped at 1.2, every token's gradient vanishes; within 0.5-2.0 none is clipped.
    assert max(float(np.abs(g).max()) for g in grads[0]) == 0.0
    assert max(float(np.abs(g).max()) for g in grads[1]) > 1e-3


@pytest.mark.parametrize("loss_fn, config", [("cispo", None), ("dro", {"beta": 0.1}), ("gspo", None),
                                             ("importance_sampling", None)])
def test_every_served_loss_trains_in_the_backend(backend, loss_fn, config):
    lps = logprobs_of(backend)
    reset(backend)
    out = backend.forward_backward(batch(loss_fn, [[1.0] * len(s) for s in lps], config,
                                         [[0.5] * len(s) for s in lps], [[lp - 0.1 for lp in s] for s in lps]))["r1"]
    assert np.isfinite(out.metrics["loss:sum"])
    assert [len(o["logprobs"]["data"]) for o in out.loss_fn_outputs] == [len(s) - 1 for s in SEQUENCES]
    assert max(float(np.abs(g).max()) for g in accumulated(backend)) > 0
