"""RL pieces that need no cluster: minibatches for substeps, the PPO clip fraction, and the sign-flip test
behind the RL quality check."""

from __future__ import annotations

import math

import pytest
import tinker

from txflow.training import rl
from txflow.training.evaluation import sign_flip_p


def datum(old: list[float], advantage: float, prompt: int = 2):
    tokens = list(range(prompt + len(old) + 1))
    return tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0.0] * prompt + [1.0] * len(old),
                        "logprobs": [0.0] * prompt + old, "advantages": [0.0] * prompt + [advantage] * len(old)})


@pytest.mark.parametrize(("n", "substeps", "sizes"), [(64, 4, [16, 16, 16, 16]), (10, 4, [2, 3, 3, 2]),
                                                       (3, 4, [1, 1, 1]), (5, 1, [5])])
def test_minibatches_split_in_order_into_nearly_equal_parts(n, substeps, sizes):
    parts = rl.minibatches(list(range(n)), substeps)
    assert [len(p) for p in parts] == sizes and [x for p in parts for x in p] == list(range(n))


def test_the_clip_fraction_counts_tokens_past_the_clip_in_their_advantages_direction():
    def output(new):
        return {"logprobs": tinker.types.TensorData.from_numpy(__import__("numpy").array([0.0, 0.0] + new))}

    old = [math.log(0.5)] * 4
    ratios_up = [1.0, 1.1, 1.3, 2.0]  # 1.3 and 2.0 are past 1.2
    ratios_down = [1.0, 0.9, 0.7, 0.5]  # 0.7 and 0.5 are past 0.8
    new_up = [math.log(0.5 * r) for r in ratios_up]
    new_down = [math.log(0.5 * r) for r in ratios_down]
    datums = [datum(old, +1.0), datum(old, -1.0), datum(old, -1.0), datum(old, 0.0)]
    outputs = [output(new_up), output(new_down), output(new_up), output(new_up)]
    # positive advantage, ratios up: 2 clipped; negative, ratios down: 2; negative, ratios up: none;
    # zero advantage: not counted.
    assert rl.clip_fraction(datums, outputs, 0.8, 1.2) == (4, 12)


def test_the_sign_flip_p_value_is_exact_for_small_samples():
    assert sign_flip_p([0.1] * 16) == 2 ** -16  # every prompt better: only the observed assignment reaches it
    assert sign_flip_p([0.0] * 16) == 1.0  # no difference: no evidence
    assert sign_flip_p([0.3, -0.1]) == 0.5  # of ++ (0.4), +- (0.2), -+ (-0.2), -- (-0.4), two reach 0.2
    assert sign_flip_p([-0.2] * 10) == 1.0  # worse everywhere
    assert 0.4 < sign_flip_p([0.1, -0.1] * 8) < 0.7
