"""Per-deployment parameters: the ONE place they are written.

Each dict holds only the `RunConfig` fields a deployment changes; every other
field keeps the default of `txflow.config.RunConfig`. An option group's fields
are nested (`"rl": {"group_size": 4}`), as the Prefect server, which checks
parameters against RunConfig's schema, takes them. `prefect.yaml` does not
repeat them: its build step `deployments.defaults.deployment_parameters` (id
`defaults`) returns them at `prefect deploy` time, and each deployment's
`parameters` refers to them as `{{ defaults.<key of CONFIGS> }}`.
`tests/test_deployments_e2e.py` validates every one against `RunConfig`.
"""

from __future__ import annotations

from txflow.config import SMOLLM2_MODEL

# train/sft and train/rl: the full default run of the mode.
SFT = {"mode": "sft"}
RL = {"mode": "rl"}

# nightly-validation/nightly: a short run of each mode on the real model, SmolLM2-135M-Instruct, as a user runs it
# (its learning rate from the cookbook's rule, halved for RL; the bundled arithmetic task), whose checks tell a
# working learner from a broken one. SFT: 6 steps; a save at step 3 exercises the periodic save_state. RL: 8 steps
# of 8 prompts x 4 samples, 4 tokens each (an answer is at most 3 digits), importance sampling: the saved sampler's
# reward against the base model's on the 24 prompts (scripts/learner_check.py, docs/modes.md, "Telling a working
# learner ...").
# 8 prompts a step: with 4, the check passes on some seeds only (docs/modes.md has the seeds measured).
NIGHTLY_SFT = {"mode": "sft", "base_model": SMOLLM2_MODEL, "steps": 6, "save_every": 3}
NIGHTLY_RL = {"mode": "rl", "base_model": SMOLLM2_MODEL, "steps": 8, "save_every": 0, "batch_size": 8,
              "rl": {"group_size": 4, "max_tokens": 4}}

# cluster/warm: a shared cluster of the default base model that runs attach to (`cluster: warm`), held until the flow
# run is cancelled; slots for a sweep of 4 and a few runs more.
CLUSTER = {"lora_adapters": 32}

# sweep/lr: the default SFT run at three learning rates around the real model's default (1.32e-3, the cookbook's
# rule), side by side on one cluster started for the sweep; the best that passed is promoted as `sweep-best`.
SWEEP = {"mode": "sft"}
SWEEP_GRID = {"learning_rates": [4e-4, 1.32e-3, 4e-3], "promote_best_as": "sweep-best"}

# What `{{ defaults.<key> }}` in prefect.yaml stands for.
CONFIGS: dict[str, dict] = {"sft": SFT, "rl": RL, "nightly_sft": NIGHTLY_SFT, "nightly_rl": NIGHTLY_RL,
                            "cluster": CLUSTER, "sweep": SWEEP}


def deployment_parameters() -> dict:
    """prefect.yaml build step (id `defaults`): `{{ defaults.sft }}` is the dict `SFT`, and so on; the sweep's
    grid is `{{ defaults.sweep_learning_rates }}` and `{{ defaults.sweep_promote_best_as }}`."""
    return {**{key: dict(value) for key, value in CONFIGS.items()},
            **{f"sweep_{key}": value for key, value in SWEEP_GRID.items()}}
