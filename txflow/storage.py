"""Checkpoint roots on any fsspec URL."""

from __future__ import annotations

from pathlib import Path

import fsspec
from fsspec.utils import get_protocol

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


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """`tinker://<model_id>/weights/<name>` -> (model_id, "state", name); `tinker://<model_id>/<name>`
    or `.../sampler_weights/<name>` -> (model_id, "sampler", name)."""
    parts = path.removeprefix("tinker://").split("/")
    if len(parts) == 3 and parts[1] == "weights":
        return parts[0], "state", parts[2]
    if len(parts) == 3 and parts[1] == "sampler_weights":
        return parts[0], "sampler", parts[2]
    if len(parts) == 2:
        return parts[0], "sampler", parts[1]
    raise ValueError(f"not a tinker checkpoint path: {path}")


def relative_checkpoint_path(tinker_path: str) -> str:
    """Where SkyRL-tx 0.3.0 writes a checkpoint, relative to its checkpoints base.

    State: a directory `<model_id>/<name>.tar.gz/` (an Orbax checkpoint despite the
    suffix); sampler: a gzip tarball `<model_id>/sampler_weights/<name>.tar.gz`.
    """
    model_id, kind, name = parse_tinker_path(tinker_path)
    return f"{model_id}/{name}.tar.gz" if kind == "state" else f"{model_id}/sampler_weights/{name}.tar.gz"


def checkpoint_urls(cfg: RunConfig, state_path: str, sampler_path: str) -> dict[str, str]:
    """Durable URLs of the two checkpoints of a save."""
    return {
        "state": f"{cfg.run_root}/{relative_checkpoint_path(state_path)}",
        "sampler": f"{cfg.run_root}/{relative_checkpoint_path(sampler_path)}",
    }


def commit_checkpoints(cfg: RunConfig, cluster, urls: dict[str, str]) -> None:
    """Make each checkpoint durable at its URL, then write its commit marker last."""
    from txflow.discovery import write_commit

    options = cfg.plain_storage_options()
    for url in urls.values():
        write_commit(url, options)
