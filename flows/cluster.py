"""The `cluster` flow: a named shared cluster held until the flow run is cancelled, so that the
Prefect UI can start and stop one; runs attach to it with `cluster: NAME` (`txflow.cluster.named`)."""

from __future__ import annotations

from prefect import flow

from txflow.cluster import named
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.processes.umask import private_files


def _down_hook(flow, flow_run, state) -> None:
    """on_cancellation / on_crashed: the flow's own finally may not run; stop the cluster from its record."""
    name = flow_run.parameters.get("name")
    if name:
        named.down(name)


@flow(name="cluster", on_cancellation=[_down_hook], on_crashed=[_down_hook])
def cluster_flow(name: str = "warm", config: RunConfig = RunConfig()) -> dict:
    """Start the shared cluster `name` with the cluster fields of `config` and hold it until cancelled."""
    with private_files():
        handle = named.up(config, name)
        get_logger().info(f"cluster {name} up on {handle.cluster.base_url}; cancel this flow run to stop it")
        records = named.hold(handle, name, config)
    return {"name": name, "processes": [r.exit_text for r in records]}
