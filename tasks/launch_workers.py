"""Step 2, launch-workers: ranks 1..N-1 once rank 0's process exists, then a
readiness request that every rank takes part in."""

from __future__ import annotations

import time

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.cluster.handle import ClusterHandle
from txflow.cluster.monitor import NoProgress
from txflow.cluster.startup import child_env, wait_for_api
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.training import evaluation
from txflow.upstream.skyrl_tx import launch


def missing_ranks(handle: ClusterHandle) -> list[str]:
    """Ranks whose log lacks the line they print once they take part in collectives."""
    missing = []
    for record in handle.cluster.processes:
        if record.role == "api":
            continue
        marker = launch.RANK_READY_MARKERS["engine" if record.rank == 0 else "worker"]
        log_text = handle.launcher.tail(record, lines=10_000)
        if marker not in log_text:
            missing.append(f"rank {record.rank} (pid {record.pid}); last lines of {record.log}:\n"
                           + "\n".join(log_text.splitlines()[-30:]))
    return missing


def prove_ready(handle: ClusterHandle, timeout_s: float) -> float:
    """A greedy sample from the base model: every rank takes part in it. It has the shape of the
    greedy samples the restore check takes later, so the program it compiles is compiled once."""
    import tinker

    started = time.monotonic()
    client = handle.service_client()
    try:
        sampler = client.create_sampling_client(base_model=handle.cluster.base_model_path)
        future = sampler.sample(prompt=tinker.types.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                                sampling_params=evaluation.greedy_params(), include_prompt_logprobs=True)
        handle.wait(future, "the readiness sample", timeout_s)
    except NoProgress as exc:
        missing = missing_ranks(handle)
        detail = "\n".join(missing) if missing else "every rank logged that it joined; the engine did not answer"
        raise NoProgress(f"Cluster not ready within {timeout_s:.0f} s. Not ready: {detail}") from exc
    return time.monotonic() - started


@task(name="launch-workers", retries=0, cache_policy=NO_CACHE)
def launch_workers(cfg: RunConfig, handle: ClusterHandle) -> ClusterHandle:
    """Start every rank > 0 now that rank 0's process exists, then prove the whole cluster serves a request."""
    with handle.deaths_first():
        return _launch_workers(cfg, handle)


def _launch_workers(cfg: RunConfig, handle: ClusterHandle) -> ClusterHandle:
    log = get_logger()
    cluster = handle.cluster
    handle.monitor.raise_if_failed()
    if cfg.processes > 1:
        # The gate is rank 0's process; each worker then waits after its imports until rank 0's
        # coordinator accepts connections (adapter point 8), instead of leaning on JAX's retries.
        log.info(f"rank 0 pid {cluster.rank(0).pid} runs; starting ranks 1..{cfg.processes - 1}, each joining "
                 f"once the coordinator {cluster.coordinator_address} accepts connections")
        env = child_env(cfg, cfg.resolved_database_url())
        for rank in range(1, cfg.processes):
            cmd = launch.worker_command(cluster.coordinator_address, cfg.processes, rank,
                                               cfg.startup_timeout_s)
            record = handle.launcher.start(cluster, "worker", rank, cmd, env, {}, f"rank{rank}")
            log.info(f"rank {rank} (JAX worker) pid {record.pid}, log {record.log}")
    wait_for_api(handle, cfg.startup_timeout_s)
    seconds = prove_ready(handle, cfg.startup_timeout_s)
    log.info(f"cluster ready: all {cfg.processes} ranks served a greedy sample ({seconds:.1f} s)")
    return handle
