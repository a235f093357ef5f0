"""Checkpoint roots on any fsspec URL."""

from __future__ import annotations

from pathlib import Path

import fsspec
from fsspec.utils import get_protocol

from txflow import skyrl_adapter
from txflow.config import RunConfig


def is_local(url: str) -> bool:
    return get_protocol(url) in ("file", "local")


def local_path(url: str) -> Path:
    return Path(url.removeprefix("file://")).absolute()


def filesystem(url: str, storage_options: dict[str, str] | None = None) -> fsspec.AbstractFileSystem:
    fs, _ = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs


def engine_checkpoints_base(cfg: RunConfig) -> str:
    """Where the engine writes: the run root itself when it is a local path."""
    if is_local(cfg.run_root):
        return str(local_path(cfg.run_root))
    return str(Path(cfg.state_dir) / "staging")


def checkpoint_urls(cfg: RunConfig, state_path: str, sampler_path: str) -> dict[str, str]:
    """Durable URLs of the two checkpoints of a save."""
    return {
        "state": f"{cfg.run_root}/{skyrl_adapter.relative_checkpoint_path(state_path)}",
        "sampler": f"{cfg.run_root}/{skyrl_adapter.relative_checkpoint_path(sampler_path)}",
    }


def commit_checkpoints(cfg: RunConfig, cluster, urls: list[str]) -> None:
    """Make each checkpoint durable at its URL, then write its commit marker last."""
    from txflow.discovery import write_commit

    options = cfg.plain_storage_options()
    for url in urls:
        write_commit(url, options)


def remove_ephemeral_samplers(checkpoints_base: str) -> list[str]:
    """Delete the transient sampler weights SkyRL-tx wrote for sampling clients; returns what went."""
    base = Path(checkpoints_base)
    removed = []
    for path in base.glob("*/sampler_weights/*"):
        relative = path.relative_to(base).as_posix()
        if skyrl_adapter.is_ephemeral_sampler(relative):
            path.unlink(missing_ok=True)
            removed.append(relative)
    return removed
