"""Teardown: stop every process of the run, whatever happened before."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.cluster.handle import ClusterHandle
from txflow.cluster.launchers import stop_cluster
from txflow.cluster.records import as_json
from txflow.log import get_logger


@task(name="teardown", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def teardown(handle: ClusterHandle | None, state_dir: str) -> list[dict]:
    """Stop the cluster (through its handle, else from `<state_dir>/cluster.json`); returns rank, pid,
    exit code and node of each process."""
    records = handle.stop() if handle is not None else stop_cluster(state_dir)
    get_logger().info(
        "teardown: " + (", ".join(f"{r.role} pid {r.pid} exit {r.exit_text}" for r in records) or "nothing to stop")
    )
    return as_json(records)
