"""Launchers place the processes of a cluster; the rest of txflow only sees the
`Launcher` interface (`txflow.cluster`). `get_launcher` is the one factory, keyed
on `RunConfig.launcher` or on the `launcher` recorded in cluster.json."""

from __future__ import annotations

from pathlib import Path

from txflow.cluster import Cluster, Launcher, ProcessRecord

LAUNCHERS = ("local",)


def get_launcher(name: str, cluster: Cluster | None = None) -> Launcher:
    """A launcher by name; given a recorded `cluster`, one that can reach and stop it."""
    if name == "local":
        from txflow.launchers.local import LocalLauncher

        return LocalLauncher()
    raise ValueError(f"unknown launcher {name!r}; choose one of {', '.join(LAUNCHERS)}")


def stop_cluster(state_dir: str | Path, launcher: Launcher | None = None, grace_s: float = 5.0) -> list[ProcessRecord]:
    """Stop the cluster recorded in `state_dir/cluster.json` (no-op when there is none)."""
    path = Path(state_dir) / "cluster.json"
    if not path.exists():
        return []
    cluster = Cluster.load(state_dir)
    return (launcher or get_launcher(cluster.launcher, cluster)).stop(cluster, grace_s)
