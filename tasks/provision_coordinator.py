"""Step 1, provision-coordinator: the Tinker API server and rank 0 (the engine,
which hosts the JAX coordinator)."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.checkpoints.storage import fresh_staging
from txflow.cluster.handle import ClusterHandle
from txflow.cluster.launcher import Launcher, PlacementFailed
from txflow.cluster.monitor import retry_unless
from txflow.cluster.records import Cluster
from txflow.cluster.startup import child_env
from txflow.config import RunConfig
from txflow.log import get_logger, register_secret
from txflow.upstream.skyrl_tx import launch
from txflow.upstream.tiny_model import resolve_base_model


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
        checkpoints_base=fresh_staging(cfg),
        **({"api_key": cfg.api_key} if cfg.api_key is not None else {}),
    )
    register_secret(cluster.api_key.get_secret_value())
    handle = None
    try:
        launcher.place(cluster, cfg.host)
        handle = ClusterHandle.watch(cluster, launcher)
        engine_argv = launch.engine_args(cfg, cluster.base_model_path, cluster.checkpoints_base,
                                         cluster.coordinator_address)
        env = child_env(cfg, db_url) | launch.wake_env()  # the API and the engine wake each other
        # The API first (it creates the database tables), then rank 0 without waiting for it: the
        # engine waits for the tables itself after its imports (adapter point 8). The API alone gets
        # the run's key, which it checks on every request (adapter point 15).
        api_env = env | launch.api_key_env(cluster.api_key.get_secret_value())
        api = launcher.start(cluster, "api", None, launch.api_command(engine_argv, cluster.host, cluster.api_port),
                             api_env, {"http": cluster.api_port}, "api")
        log.info(f"Tinker API server pid {api.pid} on {cluster.base_url}, log {api.log}")
        ports = {"coordinator": cluster.coordinator_port} if cluster.coordinator_port else {}
        rank0_env = env | launch.coordinator_env(cluster.coordinator_address)
        rank0 = launcher.start(cluster, "coordinator", 0, launch.engine_command(engine_argv), rank0_env,
                               ports, "rank0")
        log.info(
            f"rank 0 (engine{', JAX coordinator ' + cluster.coordinator_address if cluster.coordinator_port else ''}) "
            f"pid {rank0.pid}, log {rank0.log}; command: {' '.join(launch.engine_command(engine_argv))}"
        )
    except BaseException:
        # A retry must start from nothing: stop what this attempt started.
        if handle is not None:
            handle.stop()
        else:
            launcher.stop(cluster)
        raise
    return handle
