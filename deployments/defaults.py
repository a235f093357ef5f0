"""Per-deployment parameters: the ONE place they are written.

Each dict holds only the `RunConfig` fields a deployment changes; every other
field keeps the default of `txflow.config.RunConfig`. `prefect.yaml` does not
repeat them: its build step `deployments.defaults.deployment_parameters` (id
`defaults`) returns them at `prefect deploy` time, and each deployment's
`parameters` refers to them as `{{ defaults.<key of CONFIGS> }}`.
`tests/test_deployments_e2e.py` validates every one against `RunConfig`.
"""

from __future__ import annotations

# train/sft and train/rl: the full default run of the mode.
SFT = {"mode": "sft"}
RL = {"mode": "rl"}

# nightly-validation/nightly: a short run of each mode whose checks tell a working
# learner from a broken one (scripts/learner_check.py, 10 seeds each way, README).
# SFT: 6 steps gain >= 0.22 nats of held-out loss over the base model; a save at
# step 3 exercises the periodic save_state. RL: PPO with 4 substeps (so its clip
# acts) at temperature 0.25, 16 steps: the eval reward gains >= 0.13 over the base.
NIGHTLY_SFT = {"mode": "sft", "steps": 6, "save_every": 3}
NIGHTLY_RL = {"mode": "rl", "steps": 16, "save_every": 0, "loss": "ppo", "substeps": 4, "temperature": 0.25}

# cluster/warm: a shared cluster of the default base model that runs attach to (`cluster: warm`), held until the flow
# run is cancelled; slots for a sweep of 4 and a few runs more.
CLUSTER = {"lora_adapters": 32}

# What `{{ defaults.<key> }}` in prefect.yaml stands for.
CONFIGS: dict[str, dict] = {"sft": SFT, "rl": RL, "nightly_sft": NIGHTLY_SFT, "nightly_rl": NIGHTLY_RL,
                            "cluster": CLUSTER}


def deployment_parameters() -> dict[str, dict]:
    """prefect.yaml build step (id `defaults`): `{{ defaults.sft }}` is the dict `SFT`, and so on."""
    return {key: dict(value) for key, value in CONFIGS.items()}
