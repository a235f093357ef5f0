"""The `one-adapter-batches` change for model passes: a forward or forward_backward batch of several models runs as
one batch per model, in the order of their first requests, and a model whose part fails fails only its own
requests. On upstream's engine class, its processors replaced by a recorder (the sampling half:
tests/test_full_sampling_batches.py; what it is for: tests/test_view_rows.py)."""

from __future__ import annotations

import pytest
from tx.tinker import types
from tx.tinker.engine import TinkerEngine

from txflow.upstream.skyrl_tx import engine


@pytest.fixture(params=["process_forward_backward", "process_forward"])
def processor(request, monkeypatch):
    """The engine's processor `request.param`, upstream's replaced by one that records each batch it is given
    (and fails model "bad"'s), with the change installed over it; restored afterwards."""
    calls = []

    def upstream(self, requests):
        calls.append(list(requests))
        if any(model == "bad" for model, _ in requests.values()):
            raise RuntimeError("bad batch")
        return {key: f"done {key}" for key in requests}

    for name in ("process_forward_backward", "process_forward", "find_batchable_sample"):
        monkeypatch.setattr(TinkerEngine, name, getattr(TinkerEngine, name))
    monkeypatch.setattr(TinkerEngine, request.param, upstream)
    engine.batches_of_one_adapter()
    return getattr(TinkerEngine, request.param), calls


def test_a_batch_of_several_models_runs_as_one_batch_per_model_in_order(processor):
    process, calls = processor
    requests = {"1": ("b", None), "2": ("a", None), "3": ("b", None), "4": ("c", None), "5": ("a", None)}
    assert process(None, requests) == {key: f"done {key}" for key in requests}
    assert calls == [["1", "3"], ["2", "5"], ["4"]]


def test_a_batch_of_one_model_is_upstreams(processor):
    process, calls = processor
    assert process(None, {"1": ("a", None), "2": ("a", None)}) == {"1": "done 1", "2": "done 2"}
    assert calls == [["1", "2"]]


def test_a_model_whose_part_fails_fails_only_its_own_requests(processor):
    process, calls = processor
    results = process(None, {"1": ("a", None), "2": ("bad", None), "3": ("a", None), "4": ("bad", None)})
    assert (results["1"], results["3"]) == ("done 1", "done 3")
    for key in ("2", "4"):
        assert isinstance(results[key], types.ErrorResponse) and results[key].error == "bad batch"
    assert calls == [["1", "3"], ["2", "4"]]
