"""The base model's figures, computed once per cluster and shared by the runs of the process on it (a sweep's
members): keyed by the cluster and every input, computed once under concurrency, never kept when they failed.
A sweep on a real cluster sharing them is tests/test_shared_cluster_e2e.py's."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from txflow.training import base_figures


def handle_of(pid: int = 100, url: str = "http://127.0.0.1:1") -> SimpleNamespace:
    engine = SimpleNamespace(pid=pid)
    cluster = SimpleNamespace(run_id="c", base_url=url, base_model_path="/models/m", rank=lambda r: engine)
    return SimpleNamespace(cluster=cluster)


@pytest.fixture(autouse=True)
def empty():
    for held in (base_figures._figures, base_figures._locks, base_figures._offered):
        held.clear()
    yield
    for held in (base_figures._figures, base_figures._locks, base_figures._offered):
        held.clear()


class Counter:
    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


def test_a_figure_is_computed_once_per_cluster_and_inputs_and_shared_after():
    compute = Counter([[1, 2]])
    mine, _ = base_figures.shared(handle_of(), "greedy_tokens", {"prompts": [[5]]}, compute)
    assert mine == [[1, 2]]
    mine[0].append(9)  # a run's own copy: what it does with it reaches no other run
    theirs = base_figures.shared(handle_of(), "greedy_tokens", {"prompts": [[5]]}, compute)
    assert theirs == ([[1, 2]], True)
    theirs[0][0].append(7)
    assert base_figures.shared(handle_of(), "greedy_tokens", {"prompts": [[5]]}, compute) == ([[1, 2]], True)
    assert compute.calls == 1


@pytest.mark.parametrize("other", [
    {"handle": handle_of(pid=101)},  # the cluster started again: its engine is another process
    {"handle": handle_of(url="http://127.0.0.1:2")},
    {"kind": "eval_loss"},
    {"inputs": {"prompts": [[6]]}},
])
def test_another_cluster_kind_or_input_computes_its_own(other):
    compute = Counter(1.5)
    base_figures.shared(handle_of(), "greedy_tokens", {"prompts": [[5]]}, compute)
    args = {"handle": handle_of(), "kind": "greedy_tokens", "inputs": {"prompts": [[5]]}, **other}
    assert base_figures.shared(args["handle"], args["kind"], args["inputs"], compute) == (1.5, False)
    assert compute.calls == 2


def test_runs_asking_at_once_wait_for_the_first_computation():
    started, release, calls = threading.Event(), threading.Event(), []

    def compute():
        calls.append(1)
        started.set()
        assert release.wait(10)
        return 3.25

    results = []
    first = threading.Thread(target=lambda: results.append(base_figures.shared(handle_of(), "eval_loss", {}, compute)))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=lambda: results.append(base_figures.shared(handle_of(), "eval_loss", {},
                                                                                  compute)))
    second.start()
    second.join(0.2)
    assert second.is_alive()  # waiting for the first, not computing
    release.set()
    first.join(10)
    second.join(10)
    assert len(calls) == 1 and sorted(results) == [(3.25, False), (3.25, True)]


def test_a_computation_that_fails_leaves_nothing_and_the_next_run_computes():
    def broken():
        raise RuntimeError("the engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        base_figures.shared(handle_of(), "eval_loss", {}, broken)
    assert base_figures.shared(handle_of(), "eval_loss", {}, Counter(2.0)) == (2.0, False)


def test_the_process_keeps_its_latest_figures_only():
    for i in range(base_figures.KEPT + 1):
        base_figures.shared(handle_of(), "eval_loss", {"i": i}, Counter(float(i)))
    assert len(base_figures._figures) == base_figures.KEPT
    assert base_figures.shared(handle_of(), "eval_loss", {"i": base_figures.KEPT}, Counter(-1.0)) == (
        float(base_figures.KEPT), True)
    assert base_figures.shared(handle_of(), "eval_loss", {"i": 0}, Counter(-1.0)) == (-1.0, False)


def test_what_the_clusters_start_offered_is_the_runs_own_and_not_computed_again():
    offered = [[4, 5]]
    base_figures.offer(handle_of(), "greedy_tokens", {"prompts": [[5]]}, offered)
    offered[0].append(9)  # the offerer's list stays its own
    compute = Counter([[0]])
    mine = base_figures.shared(handle_of(), "greedy_tokens", {"prompts": [[5]]}, compute)
    assert mine == ([[4, 5]], False) and compute.calls == 0  # taken, not sampled again, and not another run's
    mine[0][0].append(7)
    assert base_figures.shared(handle_of(), "greedy_tokens", {"prompts": [[5]]}, compute) == ([[4, 5]], False)
    # offered for other prompts, or on another cluster: no use to this call
    assert base_figures.shared(handle_of(), "greedy_tokens", {"prompts": [[6]]}, compute) == ([[0]], False)
    assert base_figures.shared(handle_of(pid=101), "greedy_tokens", {"prompts": [[5]]}, compute) == ([[0]], False)
    assert compute.calls == 2


def test_an_offered_figure_leaves_with_the_oldest():
    base_figures.offer(handle_of(), "greedy_tokens", {}, [[1]])
    for i in range(base_figures.KEPT):
        base_figures.shared(handle_of(), "eval_loss", {"i": i}, Counter(float(i)))
    assert not base_figures._offered and len(base_figures._figures) == base_figures.KEPT
    assert base_figures.shared(handle_of(), "greedy_tokens", {}, Counter([[2]])) == ([[2]], False)
