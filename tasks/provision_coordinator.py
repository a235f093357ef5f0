"""Step 1, provision-coordinator: the Tinker API server and rank 0 (the engine,
which hosts the JAX coordinator)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow import skyrl_adapter
from txflow.cluster import Cluster, Launcher, PlacementFailed
from txflow.config import RunConfig
from txflow.handle import ClusterHandle
from txflow.log import get_logger, register_secret
from txflow.monitor import NoProgress, retry_unless
from txflow.storage import engine_checkpoints_base
from txflow.tiny_model import cache_dir, resolve_base_model


def child_env(cfg: RunConfig, database_url: str) -> dict[str, str]:
    """What every process of the cluster gets on top of its node's own environment."""
    env = {skyrl_adapter.DATABASE_URL_ENV: database_url, "PYTHONUNBUFFERED": "1",
           # Compiled programs persist across runs: a new cluster skips most of its ~10 s of JIT per rank.
           # An explicit JAX_COMPILATION_CACHE_DIR (or "" to switch it off) wins.
           "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                       str(cache_dir() / "jax-compilation")),
           # glibc gives threads up to 8 malloc arenas per core, and XLA's thread pool fragments them: a
           # rank's RSS then grows with every step (+320-350 MiB while training 100 SFT steps here, +70 MiB
           # with 2 arenas), and 2 arenas cost no step time we could measure. An explicit MALLOC_ARENA_MAX wins.
           "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")}
    if Path(cfg.base_model).is_dir() or cfg.base_model == "tiny":
        # A local model needs no hub; never let a rank try to reach one.
        env["HF_HUB_OFFLINE"] = "1"
    return env


def wait_for_api(handle: ClusterHandle, timeout_s: float) -> None:
    """Wait until the API answers /healthz (liveness of the API only, not readiness)."""
    cluster = handle.cluster
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        handle.monitor.raise_if_failed()
        try:
            if httpx.get(f"{cluster.base_url}/api/v1/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    api = next(p for p in cluster.processes if p.role == "api")
    raise NoProgress(f"The Tinker API server did not answer on {cluster.base_url} within {timeout_s:.0f} s. "
                     f"Last lines of {api.log}:\n{handle.launcher.tail(api)}")


# Retries are safe here: a failed attempt stops what it started, and the next one starts afresh (a
# port taken meanwhile, say). A cluster that cannot be placed is not retried: it would not fit now either.
@task(name="provision-coordinator", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless(PlacementFailed),
      cache_policy=NO_CACHE)
def provision_coordinator(cfg: RunConfig, launcher: Launcher) -> ClusterHandle:
    """Start the API server, then rank 0, without waiting for either (launch-workers proves them
    ready); each is in cluster.json as soon as it exists, and a monitor watches them from the start."""
    log = get_logger()
    state_dir = Path(cfg.state_dir)
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    db_url = cfg.resolved_database_url()
    cluster = Cluster(
        run_id=cfg.run_id,
        launcher=cfg.launcher,
        state_dir=str(state_dir),
        host=cfg.host,
        api_port=0,
        coordinator_port=None,
        num_processes=cfg.processes,
        base_model_path=resolve_base_model(cfg.base_model),
        checkpoints_base=engine_checkpoints_base(cfg),
        **({"api_key": cfg.api_key} if cfg.api_key is not None else {}),
    )
    register_secret(cluster.api_key.get_secret_value())
    handle = None
    try:
        launcher.place(cluster, cfg.host)
        handle = ClusterHandle.watch(cluster, launcher)
        engine_argv = skyrl_adapter.engine_args(cfg, cluster.base_model_path, cluster.checkpoints_base,
                                                cluster.coordinator_address)
        env = child_env(cfg, db_url) | skyrl_adapter.wake_env()  # the API and the engine wake each other
        # The API first (it creates the database tables), then rank 0 without waiting for it: the
        # engine waits for the tables itself after its imports (adapter point 8).
        api = launcher.start(cluster, "api", None, skyrl_adapter.api_command(engine_argv, cluster.host,
                                                                             cluster.api_port),
                             env, {"http": cluster.api_port}, "api")
        log.info(f"Tinker API server pid {api.pid} on {cluster.base_url}, log {api.log}")
        ports = {"coordinator": cluster.coordinator_port} if cluster.coordinator_port else {}
        rank0_env = env | skyrl_adapter.coordinator_env(cluster.coordinator_address)
        rank0 = launcher.start(cluster, "coordinator", 0, skyrl_adapter.engine_command(engine_argv), rank0_env,
                               ports, "rank0")
        log.info(
            f"rank 0 (engine{', JAX coordinator ' + cluster.coordinator_address if cluster.coordinator_port else ''}) "
            f"pid {rank0.pid}, log {rank0.log}; command: {' '.join(skyrl_adapter.engine_command(engine_argv))}"
        )
    except BaseException:
        # A retry must start from nothing: stop what this attempt started.
        if handle is not None:
            handle.stop()
        else:
            launcher.stop(cluster)
        raise
    return handle
