"""Launchers place the processes of a cluster; the rest of txflow only sees the
`Launcher` interface (`txflow.cluster.launcher`). `get_launcher` is the one factory: keyed
on `RunConfig.launcher` for a run, on the launcher recorded in cluster.json for a
hook or a teardown in another process."""

from __future__ import annotations

from pathlib import Path

from txflow.cluster.launcher import Launcher
from txflow.cluster.records import Cluster, ProcessRecord


def get_launcher(cfg=None, cluster: Cluster | None = None) -> Launcher:
    """The launcher of a run's config, or one that can reach and stop a recorded `cluster`."""
    name = cluster.launcher if cluster is not None else cfg.launcher
    if name == "local":
        from txflow.cluster.launchers.local import LocalLauncher

        return LocalLauncher()
    if name == "ray":
        from txflow.cluster.launchers.ray import RayLauncher

        return RayLauncher.for_cluster(cluster) if cluster is not None else RayLauncher.for_config(cfg)
    raise ValueError(f"unknown launcher {name!r}; choose local or ray")


def stop_cluster(state_dir: str | Path, launcher: Launcher | None = None, grace_s: float = 5.0) -> list[ProcessRecord]:
    """Stop the cluster recorded in `state_dir/cluster.json` (no-op when there is none)."""
    path = Path(state_dir) / "cluster.json"
    if not path.exists():
        return []
    cluster = Cluster.load(state_dir)
    return (launcher or get_launcher(cluster=cluster)).stop(cluster, grace_s)
