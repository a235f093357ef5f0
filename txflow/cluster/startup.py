"""What every process of the cluster starts with, and the wait for the API to answer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from txflow.cluster.handle import ClusterHandle
from txflow.cluster.monitor import NoProgress
from txflow.config import RunConfig
from txflow.upstream.skyrl_tx import DATABASE_URL_ENV
from txflow.upstream.tiny_model import cache_dir


def child_env(cfg: RunConfig, database_url: str) -> dict[str, str]:
    """What every process of the cluster gets on top of its node's own environment."""
    env = {DATABASE_URL_ENV: database_url, "PYTHONUNBUFFERED": "1",
           # Compiled programs persist across runs: a new cluster skips most of its ~10 s of JIT per rank.
           # An explicit JAX_COMPILATION_CACHE_DIR (or "" to switch it off) wins.
           "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                       str(cache_dir() / "jax-compilation")),
           # Every program, not only those that took 1 s or more: a rank runs ~300 small ones (collectives,
           # random seeds, staging) and compiled each again on every start. An explicit value wins.
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                                                                        "0"),
           # glibc gives threads up to 8 malloc arenas per core, and XLA's thread pool fragments them: a
           # rank's RSS then grows with every step (+320-350 MiB while training 100 SFT steps here, +70 MiB
           # with 2 arenas), and 2 arenas cost no step time we could measure. An explicit MALLOC_ARENA_MAX wins.
           "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")}
    if Path(cfg.base_model).is_dir() or cfg.base_model == "tiny":
        # A local model needs no hub; never let a rank try to reach one.
        env["HF_HUB_OFFLINE"] = "1"
    return env


def wait_for_api(handle: ClusterHandle, timeout_s: float) -> None:
    """Wait until the API answers /healthz (liveness of the API only, not readiness)."""
    cluster = handle.cluster
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        handle.monitor.raise_if_failed()
        try:
            if httpx.get(f"{cluster.base_url}/api/v1/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    api = next(p for p in cluster.processes if p.role == "api")
    raise NoProgress(f"The Tinker API server did not answer on {cluster.base_url} within {timeout_s:.0f} s. "
                     f"Last lines of {api.log}:\n{handle.launcher.tail(api)}")
