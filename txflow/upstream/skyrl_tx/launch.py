"""How each process of the cluster is started: its command line, its environment and the engine's config (the
`device-mesh`, `coordinator-bind`, `wake-channel` and `api-key-check` changes of `patches`). Every process runs
`python -m txflow.upstream.skyrl_tx`, which installs txflow's patches before upstream's code runs."""

from __future__ import annotations

import json
import sys
from typing import Any

from txflow.config import RunConfig
from txflow.upstream import wake
from txflow.upstream.skyrl_tx import TINKER_DEFAULT_RANK, models
from txflow.upstream.skyrl_tx.auth import API_KEY_ENV, LIMITS_ENV, RUN_KEYS_ENV
from txflow.upstream.skyrl_tx.served import ServedModel

ENTRY = "txflow.upstream.skyrl_tx"


def backend_config(cfg: RunConfig, coordinator_address: str | None) -> dict[str, Any]:
    """SkyRL-tx `JaxBackendConfig` for the cluster shape in `cfg`."""
    config: dict[str, Any] = {
        "fully_sharded_data_parallel_size": cfg.fsdp,
        "tensor_parallel_size": cfg.mesh.tp,
        "expert_parallel_size": cfg.mesh.ep,
        "max_lora_rank": cfg.max_lora_rank or max(TINKER_DEFAULT_RANK, cfg.lora_rank),
        "max_lora_adapters": cfg.lora_adapters,
        # Pad every sampling batch to a multiple of fsdp (a batch of one fails otherwise).
        "sample_max_num_sequences": cfg.fsdp * max(1, 8 // cfg.fsdp),
        # Upstream's default (0) runs a forward_backward over the whole batch at once: an RL step of SmolLM2-135M
        # (64 sequences) took the engine past 20 GB and the OOM killer; by 8 sequences it stays near 7 GB.
        "train_micro_batch_size": cfg.fsdp * max(1, 8 // cfg.fsdp),
        # Logprobs over 128 positions at a time (upstream: 1024): a chunk's logits over SmolLM2's 49,152-token
        # vocabulary are 25 MB in float32 instead of 200, held in several copies; a forward of 8 x 64 tokens
        # peaked ~100 MB lower, a forward_backward of 8 x 96 tokens ~200 MB, at the same speed.
        "loss_chunk_size": models.LOGPROBS_CHUNK,
    }
    if cfg.processes > 1:
        config["coordinator_address"] = coordinator_address
        config["num_processes"] = cfg.processes
    return config


def engine_args(
    cfg: RunConfig, base_model_path: str, checkpoints_base: str, coordinator_address: str | None
) -> list[str]:
    """Engine config as command-line arguments, without the database URL (it goes by environment)."""
    return [
        "--base-model",
        base_model_path,
        "--backend",
        "jax",
        "--backend-config",
        json.dumps(backend_config(cfg, coordinator_address)),
        "--checkpoints-base",
        checkpoints_base,
        # The client of a txflow run heartbeats while it runs; a crashed client's
        # adapters are freed after this long instead of leaking slots.
        "--session-timeout-sec",
        "120",
    ]


def wake_env() -> dict[str, str]:
    """Environment for the API and rank 0 (the engine) of one cluster: the name of their wake channel
    (`wake-channel`)."""
    return {wake.ENV: wake.new_name()}


def api_key_env(key: str) -> dict[str, str]:
    """Environment for the API: the key it lets in (`api-key-check`); never its command line."""
    return {API_KEY_ENV: key}


def api_limits_env(cfg) -> dict[str, str]:
    """Environment for the API: what one request and one run's key may ask of it (`RunConfig.api_max_*`)."""
    return {LIMITS_ENV: json.dumps({"body_mb": cfg.api_max_body_mb, "samples": cfg.api_max_samples,
                                    "tokens": cfg.api_max_tokens, "batch": cfg.api_max_batch,
                                    "sessions": cfg.api_max_sessions_per_key,
                                    "models": cfg.api_max_models_per_key})}


def served_model_env(cfg, base_model_path: str) -> dict[str, str]:
    """Environment for the API: the names its model is served under (`served`): the Hugging Face id of a
    named model, the name the run gave, the path the engine loads."""
    from txflow.config import NAMED_MODELS

    named = NAMED_MODELS.get(cfg.base_model)
    return ServedModel.of(cfg.base_model, base_model_path, named.hf_id if named else None).env()


def run_keys_env(path: str) -> dict[str, str]:
    """Environment for the API of a shared cluster: the file of its attached runs' keys (`api-key-check`)."""
    return {RUN_KEYS_ENV: path}


def coordinator_env(coordinator_address: str | None) -> dict[str, str]:
    """Environment for rank 0 so the JAX coordinator binds only the configured interface."""
    return {"JAX_COORDINATOR_BIND_ADDRESS": coordinator_address} if coordinator_address else {}


def engine_command(engine_argv: list[str]) -> list[str]:
    """Rank 0: the engine, which hosts the JAX coordinator (with txflow's checkpoint I/O, `rank0-checkpoint-io`)."""
    return [sys.executable, "-m", ENTRY, "engine", *engine_argv]


def api_command(engine_argv: list[str], host: str, port: int) -> list[str]:
    """The Tinker API server, without the engine it would otherwise spawn through `uv`. It serves on the
    socket its launcher bound on `host:port` and handed to it (`txflow.processes.ports.LISTEN_FD_ENV`);
    started by hand, without one, it binds `host:port` itself."""
    return [sys.executable, "-m", ENTRY, "api", "--host", host, "--port", str(port), *engine_argv]


def worker_command(coordinator_address: str, num_processes: int, rank: int, gate_timeout_s: float) -> list[str]:
    """Rank > 0: a JAX worker that receives the model and config from rank 0 by broadcast. It joins
    once rank 0's coordinator accepts connections, and gives up after `gate_timeout_s` (`self-gated-startup`)."""
    return [
        sys.executable,
        "-m",
        ENTRY,
        "worker",
        "--gate-timeout",
        str(gate_timeout_s),
        "--coordinator-address",
        coordinator_address,
        "--num-processes",
        str(num_processes),
        "--process-id",
        str(rank),
    ]


# rank that is missing when readiness times out.
RANK_READY_MARKERS = {
    "engine": "Starting background engine",
    "worker": "entering command loop",
}
