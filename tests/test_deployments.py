"""prefect.yaml without a server: every deployment's parameters resolve to a valid RunConfig, and the
file holds nothing of this machine (tests/test_deployments_e2e.py deploys it to a real server)."""

from __future__ import annotations

from pathlib import Path

import yaml

from txflow.config import RunConfig

REPO = Path(__file__).resolve().parents[1]


def _prefect_yaml() -> dict:
    return yaml.safe_load((REPO / "prefect.yaml").read_text())


def _resolved_parameters(spec: dict) -> dict[str, dict]:
    """Deployment name -> parameters, with the build steps' outputs filled in as `prefect deploy` does."""
    from prefect.utilities.importtools import import_object
    from prefect.utilities.templating import apply_values

    outputs: dict = {}
    for step in spec.get("build") or []:
        (fqn, inputs), = step.items()
        inputs = dict(inputs or {})
        step_id = inputs.pop("id", None)
        inputs.pop("requires", None)
        output = import_object(fqn)(**inputs)
        outputs.update(output)
        if step_id:
            outputs[step_id] = output
    return {d["name"]: apply_values(d.get("parameters") or {}, outputs) for d in spec["deployments"]}


def test_every_deployment_parameter_is_a_valid_run_config():
    from deployments import defaults

    spec = _prefect_yaml()
    params = _resolved_parameters(spec)
    assert set(params) == {"sft", "rl", "nightly", "warm", "lr"}
    for name, deployment_params in params.items():
        raw = next(d["parameters"] for d in spec["deployments"] if d["name"] == name)
        assert set(deployment_params) == set(raw), f"{name}: a template did not resolve: {raw}"
        for key, value in deployment_params.items():
            if (name, key) in {("warm", "name"), ("lr", "learning_rates"), ("lr", "promote_best_as")}:
                continue
            assert isinstance(value, dict), f"{name}.{key} is {value!r}"
            RunConfig.model_validate(value)
    assert RunConfig.model_validate(params["sft"]["config"]).mode == "sft"
    # The sweep's grid resolves to what the sweep flow takes: a list of floats around the real model's default.
    sweep = params["lr"]
    assert sweep["learning_rates"] == [4e-4, 1.32e-3, 4e-3] and sweep["promote_best_as"] == "sweep-best"
    assert RunConfig.model_validate(sweep["config"]).base_model == "smollm2-135m"
    assert RunConfig.model_validate(params["rl"]["config"]).mode == "rl"
    assert RunConfig.model_validate(params["warm"]["config"]).lora_adapters == 32
    nightly = {k: RunConfig.model_validate(v) for k, v in params["nightly"].items()}
    assert (nightly["sft"].mode, nightly["rl"].mode) == ("sft", "rl")
    assert params["nightly"] == {"sft": defaults.NIGHTLY_SFT, "rl": defaults.NIGHTLY_RL}


def test_prefect_yaml_is_portable():
    text = (REPO / "prefect.yaml").read_text()
    spec = _prefect_yaml()
    assert str(REPO) not in text and "/root" not in text and "/tmp" not in text
    assert "git_clone" not in text
    assert spec["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $PWD }}"}}]
    entrypoints = {d["name"]: d["entrypoint"] for d in spec["deployments"]}
    assert entrypoints == {"sft": "flows/train.py:train_flow", "rl": "flows/train.py:train_flow",
                           "nightly": "deployments/nightly.py:nightly_validation",
                           "warm": "flows/cluster.py:cluster_flow", "lr": "flows/sweep.py:sweep_flow"}
    assert all((REPO / e.split(":")[0]).is_file() for e in entrypoints.values())
    assert {d["work_pool"]["name"] for d in spec["deployments"]} == {"txflow"}
