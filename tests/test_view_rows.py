"""`one-adapter-batches` on the real model: a batch of one adapter samples each of its rows as that row
alone gives, whatever rows of the adapter come beside it (tests/view_rows_probe.py). With the engine's batches of
one adapter each (tests/test_full_sampling_batches.py), a sampler's figures do not depend on what the cluster's other
runs sample: a sweep member's live and restored samplers agree exactly, as its restore check requires. Upstream's
engine would batch another adapter's rows beside them, and in bfloat16 that program rounds them apart."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_one_adapters_rows_sample_the_same_figures_whatever_rows_of_it_are_beside_them(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tests.view_rows_probe"], capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["dtype"] == "torch.bfloat16"
    for alone, among in zip(found["alone"], found["among"], strict=True):
        assert alone == among  # tokens, their logprobs and the prompt's, exactly
    # The adapter's factors are in play: the base model's figures for the same prompts are others.
    assert all(a["prompt_logprobs"] != b["prompt_logprobs"] for a, b in zip(found["alone"], found["base"]))
