"""Teardown: stop every process of the run, whatever happened before."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.cluster import Launcher, as_json, stop_cluster
from txflow.log import get_logger
from txflow.tinker_client import close_clients


@task(name="teardown", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def teardown(state_dir: str, launcher: Launcher | None = None) -> list[dict]:
    """Stop the cluster recorded in `<state_dir>/cluster.json`; returns rank, pid and exit code of each process."""
    close_clients(state_dir)  # first: their heartbeats would only fail once the API is gone
    records = stop_cluster(Path(state_dir), launcher)
    get_logger().info(
        "teardown: " + (", ".join(f"{r.role} pid {r.pid} exit {r.exit_code}" for r in records) or "nothing to stop")
    )
    return as_json(records)
