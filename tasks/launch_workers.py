"""Step 2, launch-workers: ranks 1..N-1 behind a gate on rank 0, then a
readiness request that every rank takes part in."""

from __future__ import annotations

import time

import tinker
from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow import processes, skyrl_adapter
from txflow.cluster import Cluster, Launcher, describe_exit
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.tinker_client import RankDied, check_ranks, service_client, wait_result
from tasks.provision_coordinator import child_env


def gate_on_coordinator(cluster: Cluster, launcher: Launcher, timeout_s: float) -> None:
    """Block until rank 0's process runs and its JAX coordinator accepts connections.

    Workers started before that would lean on JAX's connection retries; this gate
    makes the order explicit and fails with rank 0's log if it dies instead.
    """
    rank0 = cluster.rank(0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = launcher.exit_code(rank0)
        if code is not None:
            raise RankDied(f"Rank 0 died before workers could join: {describe_exit(rank0, code)}", 0, code)
        if processes.port_open(cluster.host, cluster.coordinator_port):
            return
        time.sleep(0.2)
    raise TimeoutError(
        f"Rank 0's JAX coordinator did not listen on {cluster.coordinator_address} within {timeout_s:.0f} s. "
        f"Last lines of {rank0.log}:\n{processes.tail(rank0.log)}"
    )


def missing_ranks(cluster: Cluster) -> list[str]:
    """Ranks whose log lacks the line they print once they take part in collectives."""
    missing = []
    for record in cluster.processes:
        if record.role == "api":
            continue
        marker = skyrl_adapter.RANK_READY_MARKERS["engine" if record.rank == 0 else "worker"]
        log_text = open(record.log, errors="replace").read() if record.log else ""
        if marker not in log_text:
            missing.append(f"rank {record.rank} (pid {record.pid}); last lines of {record.log}:\n"
                           f"{processes.tail(record.log)}")
    return missing


def prove_ready(cluster: Cluster, launcher: Launcher, timeout_s: float) -> float:
    """A one-token sample from the base model: every rank takes part in it."""
    started = time.monotonic()
    client = service_client(cluster)
    try:
        sampler = client.create_sampling_client(base_model=cluster.base_model_path)
        future = sampler.sample(
            prompt=tinker.types.ModelInput.from_ints([1, 2, 3]),
            num_samples=1,
            sampling_params=tinker.types.SamplingParams(max_tokens=1, temperature=0.0),
        )
        wait_result(future, cluster, launcher, timeout_s, "the readiness sample")
    except TimeoutError as exc:
        missing = missing_ranks(cluster)
        detail = "\n".join(missing) if missing else "every rank logged that it joined; the engine did not answer"
        raise TimeoutError(f"Cluster not ready within {timeout_s:.0f} s. Not ready: {detail}") from exc
    return time.monotonic() - started


@task(name="launch-workers", retries=0, cache_policy=NO_CACHE)
def launch_workers(cfg: RunConfig, cluster: Cluster, launcher: Launcher) -> Cluster:
    """Start every rank > 0 once rank 0 is up, then prove the whole cluster serves a request."""
    log = get_logger()
    if cfg.processes > 1:
        gate_on_coordinator(cluster, launcher, cfg.startup_timeout_s)
        log.info(f"gate passed: rank 0 pid {cluster.rank(0).pid} runs and its coordinator "
                 f"{cluster.coordinator_address} accepts connections; starting ranks 1..{cfg.processes - 1}")
        env = child_env(cfg, cfg.resolved_database_url())
        for rank in range(1, cfg.processes):
            cmd = skyrl_adapter.worker_command(cluster.coordinator_address, cfg.processes, rank)
            record = launcher.start(cluster, "worker", rank, cmd, env, {}, f"rank{rank}")
            log.info(f"rank {rank} (JAX worker) pid {record.pid}, log {record.log}")
    check_ranks(cluster, launcher)
    seconds = prove_ready(cluster, launcher, cfg.startup_timeout_s)
    log.info(f"cluster ready: all {cfg.processes} ranks served a one-token sample ({seconds:.1f} s)")
    return cluster
