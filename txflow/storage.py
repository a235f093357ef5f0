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
