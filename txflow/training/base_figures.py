"""What the base model computes on a cluster, computed once and shared by the runs of this process that use the
same cluster: a sweep's members (threads of the sweep's process) evaluate the base model on the same held-out
prompts, examples and seeds. Each member but the first saves that much of the engine's time: on SmolLM2, four
sampling batches and a forward pass; for RL, the base model's `group_size` samples of every prompt besides.

A figure is keyed by the cluster (its API and its engine's process: a cluster started again, after a fault, is
another one) and by everything its computation reads, so a run whose prompts, examples or seeds differ computes
its own. The base model's weights do not change while a cluster lives, and its programs are the same for every
run on it, so a shared figure is the one the run would have computed. Concurrent runs asking for the same figure
wait for the first; one that fails leaves nothing behind, and the next computes it. The process keeps the
figures of its last `KEPT` computations (a worker that runs many deployments does not grow without end).

A run's own cluster also offers what it computed as it started (`offer`): its readiness sample is the base model's
greedy answers to the run's held-out prompts, which the run's live reference then takes as its own."""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from txflow.cluster.handle import ClusterHandle

T = TypeVar("T")

KEPT = 64
_figures: OrderedDict[str, object] = OrderedDict()
_offered: set[str] = set()  # figures the cluster's own start computed: its run's own, not shared
_locks: dict[str, threading.Lock] = {}
_guard = threading.Lock()


def cluster_identity(handle: ClusterHandle) -> list:
    """What tells one live cluster from another: its API's address, its engine's process and its base model."""
    cluster = handle.cluster
    engine = cluster.rank(0)
    return [cluster.run_id, cluster.base_url, engine.pid if engine is not None else None, cluster.base_model_path]


def _key(handle: ClusterHandle, kind: str, inputs: object) -> str:
    # (`repr` for what JSON cannot hold: an object printed with its address keys a figure no other run shares)
    return hashlib.sha256(json.dumps([cluster_identity(handle), kind, inputs], default=repr).encode()).hexdigest()


def _keep(key: str, figure: object) -> None:
    """Hold `figure` under `key` (a copy: the caller's own stays the caller's); the caller holds `_guard`."""
    _figures[key] = copy.deepcopy(figure)
    while len(_figures) > KEPT:
        dropped = _figures.popitem(last=False)[0]
        _locks.pop(dropped, None)
        _offered.discard(dropped)


def shared(handle: ClusterHandle, kind: str, inputs: object, compute: Callable[[], T]) -> tuple[T, bool]:
    """(the figure, whether it was shared): `compute()` once per cluster, `kind` and `inputs` (JSON-able: every
    value the computation reads besides the base model); later callers get a copy of what it returned. A figure
    the cluster's own start offered is the caller's own (not shared): only a run's own cluster offers."""
    key = _key(handle, kind, inputs)
    with _guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        with _guard:
            if key in _figures:
                _figures.move_to_end(key)
                return copy.deepcopy(_figures[key]), key not in _offered  # type: ignore[return-value]
        figure = compute()
        with _guard:
            _keep(key, figure)
        return figure, False


def offer(handle: ClusterHandle, kind: str, inputs: object, figure: object) -> None:
    """Keep what a run's own cluster computed as it started (its readiness sample's greedy tokens of the base
    model), so that the run's `shared` call for the same `kind` and `inputs` takes it instead of computing it."""
    key = _key(handle, kind, inputs)
    with _guard:
        _keep(key, figure)
        _offered.add(key)
