"""Tinker's losses in txflow's engine (txflow.upstream.skyrl_tx.losses, the `tinker-losses` change).

Each loss against the code of its page in Tinker's documentation (tinker-docs.thinkingmachines.ai,
"Loss Functions": cross_entropy on the index page; importance_sampling, ppo, cispo, dro, gspo on their
own), copied literally below: the loss and its gradient with respect to the target logprobs, on
hand-made tokens where clipping acts and where it does not. Where txflow deliberately differs (dro's
penalty on prompt tokens) a test shows by how much and says why. Then the backend itself, in this
process on the tiny model: a loss is the sum over tokens and sequences, so the gradient of
forward_backward_custom's second pass (cross_entropy with weights -dL/dlogprob) is the gradient of the
user's loss; `loss:sum` of every loss is the sum of its per-token losses, also with real-valued weights
that nearly cancel; a new configuration reaches the compiled program. The API's refusals are checked on
the real app; the SDKs' clients run these losses end to end in test_sdk_matrix_e2e.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from txflow.upstream.skyrl_tx import losses

pytestmark = [pytest.mark.together]

# Token 0 is a prompt token (sampling logprob 0.0, no advantage), as the SDKs and the cookbook send it;
# tokens 1-5 are sampled. Ratios exp(target - sampling) of the sampled tokens: 1.22, 0.67, 1.0, 18.2, 0.99.
TARGET = [-0.7, -1.0, -0.5, -2.0, -0.1, -1.31]
SAMPLING = [0.0, -1.2, -0.1, -2.0, -3.0, -1.3]
ADVANTAGES = [0.0, 1.0, -1.0, 0.5, 2.0, -0.5]
ONES = [1.0] * 6  # the weights SkyRL-tx gives an RL datum, which carries none
SAMPLED = [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # gspo's sequence_ratio_mask, as a 0.38 client sends it
PROMPT = 0


def page(name: str, config: dict, target_logprobs, sampling_logprobs, advantages, weights, sequence_ratio_mask):
    """The code of each loss's page, as the page writes it (only the config's names spelled out)."""
    clip_low_threshold, clip_high_threshold = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    beta = config.get("beta")
    ref_logprobs = sampling_logprobs  # gspo's page calls them so
    if name == "cross_entropy":
        return -(target_logprobs * weights).sum()
    if name == "importance_sampling":
        prob_ratio = torch.exp(target_logprobs - sampling_logprobs)
        return -(prob_ratio * advantages).sum()
    if name == "ppo":
        prob_ratio = torch.exp(target_logprobs - sampling_logprobs)
        clipped_ratio = torch.clamp(prob_ratio, clip_low_threshold, clip_high_threshold)
        unclipped_objective = prob_ratio * advantages
        clipped_objective = clipped_ratio * advantages
        ppo_objective = torch.min(unclipped_objective, clipped_objective)
        return -ppo_objective.sum()
    if name == "cispo":
        prob_ratio = torch.exp(target_logprobs - sampling_logprobs)
        clipped_ratio = torch.clamp(prob_ratio, clip_low_threshold, clip_high_threshold)
        cispo_objective = clipped_ratio.detach() * target_logprobs * advantages
        return -cispo_objective.sum()
    if name == "dro":
        quadratic_term = (target_logprobs - sampling_logprobs) ** 2
        dro_objective = target_logprobs * advantages - 0.5 * beta * quadratic_term
        return -dro_objective.sum()
    if name == "gspo":
        in_ratio = sequence_ratio_mask != 0
        log_ratio = (target_logprobs.detach() - ref_logprobs)[in_ratio].mean()
        ratio = torch.exp(log_ratio + target_logprobs - target_logprobs.detach())
        clipped_ratio = torch.clamp(ratio, clip_low_threshold, clip_high_threshold)
        return -torch.min(ratio * advantages, clipped_ratio * advantages).sum()
    raise ValueError(name)


def page_figures(name, config, target=TARGET, sampling=SAMPLING, advantages=ADVANTAGES, weights=ONES,
                 mask=SAMPLED):
    tlp = torch.tensor(target, dtype=torch.float64, requires_grad=True)
    loss = page(name, config, tlp, *(torch.tensor(x, dtype=torch.float64) for x in (sampling, advantages, weights,
                                                                                   mask)))
    loss.backward()
    return float(loss), tlp.grad.numpy()


def engine_figures(name, config, target=TARGET, sampling=SAMPLING, advantages=ADVANTAGES, weights=ONES):
    """The engine's loss summed over the tokens, and its gradient (the loss table's entry, scaled as the
    backend compiles it, and divided by the sum of the weights as upstream divides it)."""
    entry = losses.summed(losses.loss_function(losses.resolved(name, config)))
    w, slp, adv = (jnp.asarray(x, dtype=jnp.float32) for x in (weights, sampling, advantages))

    def total(tlp):
        return entry(tlp, w, slp, adv).sum() / jnp.maximum(w.sum(), 1e-9)

    grad = jax.grad(total)(jnp.asarray(target, dtype=jnp.float32))
    per_token = entry(jnp.asarray(target, dtype=jnp.float32), w, slp, adv)
    return float(per_token.sum()), np.asarray(grad)


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
IDS = [f"{n}-{c}" for n, c in CASES]


def with_defaults(name, config):
    return {**losses.DEFAULTS.get(name, {}), **config}


def sampled_only(values):
    return [v for i, v in enumerate(values) if i != PROMPT]


@pytest.mark.parametrize("name, config", CASES, ids=IDS)
def test_each_loss_and_its_gradient_are_its_pages_on_sampled_tokens(name, config):
    config = with_defaults(name, config)
    target, sampling, advantages = (sampled_only(x) for x in (TARGET, SAMPLING, ADVANTAGES))
    value, grad = engine_figures(name, config, target, sampling, advantages, weights=[1.0] * 5)
    expected_value, expected_grad = page_figures(name, config, target, sampling, advantages, [1.0] * 5, [1.0] * 5)
    assert value == pytest.approx(expected_value, rel=1e-5, abs=1e-5)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, config", [c for c in CASES if c[0] != "dro"],
                         ids=[i for i, c in zip(IDS, CASES) if c[0] != "dro"])
def test_with_a_prompt_token_every_loss_but_dro_is_still_its_page(name, config):
    # The prompt token carries no advantage (and cross_entropy's weight 0), so the pages' sums over all N
    # tokens leave it out too; gspo's mask marks the sampled tokens.
    config = with_defaults(name, config)
    weights = SAMPLED if name == "cross_entropy" else ONES
    value, grad = engine_figures(name, config, weights=weights)
    expected_value, expected_grad = page_figures(name, config, weights=weights)
    assert value == pytest.approx(expected_value, rel=1e-5, abs=1e-5)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-6)
    assert grad[PROMPT] == 0


@pytest.mark.parametrize("beta", [0.05, 2.0])
def test_dros_penalty_leaves_out_the_prompt_tokens_that_its_page_penalizes(beta):
    # Deliberate (losses.py's docstring): the page's penalty runs over all N tokens, so on a prompt token,
    # whose "sampling logprob" is the SDKs' placeholder 0.0, it is beta/2 * logprob^2 and would train the
    # model to predict the prompt. txflow's loss is lower by exactly that, with no gradient there.
    value, grad = engine_figures("dro", {"beta": beta})
    page_value, page_grad = page_figures("dro", {"beta": beta})
    prompt_penalty = 0.5 * beta * TARGET[PROMPT] ** 2
    assert value == pytest.approx(page_value - prompt_penalty, rel=1e-5)
    assert grad[PROMPT] == 0 and page_grad[PROMPT] == pytest.approx(beta * TARGET[PROMPT])
    np.testing.assert_allclose(grad[1:], page_grad[1:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, config", [("gspo", {}),
                                          ("gspo", {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0}),
                                          ("dro", {"beta": 2.0})])
def test_a_sampled_token_whose_sampling_logprob_is_exactly_zero_still_counts(name, config):
    # A bf16 model returns exactly 0.0 for a token it samples with p > ~0.97: token 3 here. It
    # has an advantage, so it is a sampled token: in gspo's sequence ratio, under dro's penalty.
    config = with_defaults(name, config)
    sampling = SAMPLING[:3] + [0.0] + SAMPLING[4:]
    target = TARGET[:3] + [-0.4] + TARGET[4:]
    value, grad = engine_figures(name, config, target, sampling)
    page_value, page_grad = page_figures(name, config, target, sampling)
    if name == "dro":  # the page's, less its prompt-token penalty (see above)
        page_value -= 0.5 * config["beta"] * target[PROMPT] ** 2
        page_grad[PROMPT] = 0.0
    assert value == pytest.approx(page_value, rel=1e-5)
    np.testing.assert_allclose(grad, page_grad, rtol=1e-5, atol=1e-6)
    assert losses.sampled_tokens(ONES, sampling, ADVANTAGES) == [m != 0 for m in SAMPLED]


REAL_WEIGHTS = [0.0, 0.3, -0.1, -0.2, 1.7, 0.25]  # 0.3 - 0.1 - 0.2 nearly cancels in float32


@pytest.mark.parametrize("name, config", CASES, ids=IDS)
def test_real_valued_weights_scale_each_tokens_loss(name, config):
    # cross_entropy's page multiplies by them; the RL pages take no weights (the SDKs send none and SkyRL-tx
    # gives every token 1), and txflow scales each token's loss by a client's own weights.
    config = with_defaults(name, config)
    entry = losses.loss_function(losses.resolved(name, config))
    args = [jnp.asarray(x, dtype=jnp.float32) for x in (TARGET, REAL_WEIGHTS, SAMPLING, ADVANTAGES)]
    unweighted = entry(args[0], jnp.ones(6, dtype=jnp.float32), *args[2:])
    if name == "gspo":  # its ratio runs over the tokens with a weight: give the unweighted one the same
        unweighted = entry(args[0], jnp.asarray([w != 0 for w in REAL_WEIGHTS], dtype=jnp.float32), *args[2:])
    np.testing.assert_allclose(np.asarray(entry(*args)), np.asarray(REAL_WEIGHTS) * np.asarray(unweighted),
                               rtol=1e-6, atol=1e-7)
    if name == "cross_entropy":
        expected = page_figures(name, config, weights=REAL_WEIGHTS)
        got = engine_figures(name, config, weights=REAL_WEIGHTS)
        assert got[0] == pytest.approx(expected[0], rel=1e-5)
        np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["ppo", "cispo", "gspo"])
def test_clipping_acts_on_these_inputs_and_a_wider_band_lifts_it(name):
    # Else the cases above would not tell clipped from unclipped.
    narrow, wide = engine_figures(name, {}), engine_figures(name, {"clip_low_threshold": 0.01,
                                                                  "clip_high_threshold": 100.0})
    assert not np.allclose(narrow[1], wide[1])


def test_swapped_clip_bounds_and_a_flipped_sign_would_not_match():
    # What the comparison catches: ppo with its bounds swapped, importance sampling with its sign flipped.
    swapped = engine_figures("ppo", {"clip_low_threshold": 1.2, "clip_high_threshold": 0.8})
    assert not np.allclose(swapped[1], page_figures("ppo", {"clip_low_threshold": 0.8,
                                                           "clip_high_threshold": 1.2})[1])
    flipped = -engine_figures("importance_sampling", {})[0]
    assert flipped != pytest.approx(page_figures("importance_sampling", {})[0])


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


def test_a_gspo_sequence_ratio_mask_must_mark_the_sampled_tokens():
    inputs = {"target_tokens": [1, 2, 3], "weights": [0.0, 1.0, 1.0], "logprobs": [0.0, -1.0, -2.0]}
    assert losses.datum_problem("gspo", {**inputs, "sequence_ratio_mask": [0, 1, 1]}) is None
    assert "must mark exactly the sampled tokens" in losses.datum_problem("gspo", {**inputs,
                                                                                 "sequence_ratio_mask": [1, 1, 1]})
    assert losses.datum_problem("ppo", {**inputs, "sequence_ratio_mask": [1, 1, 1]}) is None
    # A bf16 sampler's 0.0 on a confident sampled token: its advantage marks it sampled.
    confident = {**inputs, "logprobs": [0.0, 0.0, -2.0], "advantages": [0.0, 1.0, 1.0]}
    assert losses.datum_problem("gspo", {**confident, "sequence_ratio_mask": [0, 1, 1]}) is None


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


# Per sequence: real-valued weights, the first sequence's nearly cancelling (float64 sum 5.6e-17, float32
# sum 7.5e-9: a scale taken in one dtype and divided out in the other was off by 7x here).
CANCELLING = [[0.3, -0.1, -0.2, 0.0, 0.0, 0.0], [1.5, 0.25, -0.75, 2.0]]


def page_per_token(name, config, tlp, slp, adv, w) -> list[float]:
    """Each token's loss by its page, times its weight. gspo's ratio is its sequence's: the page on the
    whole sequence (the tokens with a weight in the ratio) with that token's advantage alone."""
    if name == "gspo":
        mask = [x != 0 for x in w]
        return [w[t] * page_figures(name, config, tlp, slp, [a if i == t else 0.0 for i, a in enumerate(adv)],
                                    [1.0] * len(tlp), mask)[0] for t in range(len(tlp))]
    return [w[t] * page_figures(name, config, [tlp[t]], [slp[t]], [adv[t]], [1.0], [1.0])[0] for t in range(len(tlp))]


@pytest.mark.parametrize("name, config", CASES, ids=IDS)
def test_loss_sum_of_every_loss_is_the_sum_of_its_pages_per_token_losses(backend, name, config):
    config = with_defaults(name, config)
    lps = logprobs_of(backend)
    sampling = [[lp - 0.3 * (i % 3) for i, lp in enumerate(seq)] for seq in lps]
    advantages = [[1.0 if k == 0 else -0.5] * len(seq) for k, seq in enumerate(lps)]
    out = backend.forward(batch(name, CANCELLING, config, advantages, sampling))["r1"]
    expected, scale = 0.0, 0.0
    for output, tlp, slp, adv, w in zip(out.loss_fn_outputs, lps, sampling, advantages, CANCELLING):
        assert output["logprobs"]["data"] == pytest.approx(tlp, abs=1e-6)
        per_token = page_per_token(name, config, tlp, slp, adv, w)
        np.testing.assert_allclose(output["elementwise_loss"]["data"], per_token, rtol=1e-4, atol=1e-6)
        expected += float(np.sum(per_token))
        scale += float(np.abs(per_token).sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5 * scale)


def test_a_bfloat16_sampler_gives_a_confident_token_a_logprob_of_exactly_zero_and_it_still_counts():
    # Why the logprob alone cannot tell a sampled token from a prompt token: SkyRL-tx's own logits_to_logprobs
    # on bfloat16 logits gives a token of p ~ 0.975 exactly 0.0, the prompt tokens' placeholder.
    from tx.utils.logits_processor import LogitsProcessorMixin

    logits = jnp.asarray([[20.0, 16.0, 15.0, 12.0]], dtype=jnp.bfloat16)
    confident = float(LogitsProcessorMixin.logits_to_logprobs(logits, jnp.asarray([0]))[0])
    assert confident == 0.0
    # Token 0 a prompt token, token 1 sampled with that logprob (its advantage marks it), token 2 sampled.
    assert losses.sampled_tokens([0.0, 1.0, 1.0], [0.0, confident, -1.2], [0.0, 0.5, 0.5]) == [False, True, True]
