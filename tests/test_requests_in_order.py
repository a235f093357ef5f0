"""The `requests-in-order` change: a model's single requests (an optimizer step, an unload) wait for that model's
earlier requests that the engine's pass did not take, on upstream's own looks and tables in a real SQLite database.
The engine looks for model passes, then samples, then single requests, each a read of its own: what is stored in
between is what the test stores between the looks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sqlmodel import Session, SQLModel, create_engine
from tx.tinker import types
from tx.tinker.db_models import FutureDB, RequestStatus
from tx.tinker.engine import TinkerEngine

from txflow.upstream.skyrl_tx import engine


@pytest.fixture
def looks(monkeypatch, tmp_path):
    """The engine's three looks with the changes installed as the engine installs them (restored afterwards), over
    a fresh database; and a function that stores a request."""
    for name in ("find_batchable_model_passes", "find_batchable_sample", "find_single_requests"):
        monkeypatch.setattr(TinkerEngine, name, getattr(TinkerEngine, name))
    engine.batches_of_one_adapter()
    engine.fills_sampling_batches()
    engine.each_models_requests_in_order()
    db = create_engine(f"sqlite:///{tmp_path / 'tinker.db'}")
    SQLModel.metadata.create_all(db)
    holder = SimpleNamespace(db_engine=db, config=SimpleNamespace(backend="jax"),
                             backend=SimpleNamespace(config=SimpleNamespace(sample_max_num_sequences=8)))
    pass_input = types.ForwardBackwardInput(data=[types.Datum(
        model_input=types.ModelInput(chunks=[types.ModelInputChunk(tokens=[1, 2, 3])]),
        loss_fn_inputs={"target_tokens": {"data": [2, 3, 4], "dtype": "int64", "shape": [3]},
                        **{name: {"data": [1.0, 1.0, 1.0], "dtype": "float32", "shape": [3]}
                           for name in ("weights", "advantages", "logprobs")}})],
        loss_fn="cross_entropy").model_dump()
    sample_input = types.SampleInput(prompt=types.ModelInput(chunks=[types.ModelInputChunk(tokens=[1] * 3)]),
                                      sampling_params=types.SamplingParams(temperature=0.0, max_tokens=4, seed=0),
                                      num_samples=1, checkpoint_id="live", prompt_logprobs=False).model_dump()
    data = {types.RequestType.FORWARD_BACKWARD: pass_input, types.RequestType.SAMPLE: sample_input,
            types.RequestType.OPTIM_STEP: {}, types.RequestType.UNLOAD_MODEL: {}}

    def store(model: str, request_type) -> str:
        with Session(db) as session:
            future = FutureDB(request_type=request_type, model_id=model, request_data=data[request_type])
            session.add(future)
            session.commit()
            return str(future.request_id)

    def done(request_id: str) -> None:  # the engine ran it
        with Session(db) as session:
            future = session.get(FutureDB, int(request_id))
            future.status = RequestStatus.COMPLETED
            session.add(future)
            session.commit()

    def look(kind: str, *args) -> list[str]:
        with Session(db) as session:
            return list(getattr(TinkerEngine, kind)(holder, session, *args))

    return store, look, done


def test_an_optimizer_step_waits_for_its_gradient_stored_after_the_pass_looked_for_model_passes(looks):
    store, look, done = looks
    a_pass = store("a", types.RequestType.FORWARD_BACKWARD)
    assert look("find_batchable_model_passes", types.RequestType.FORWARD_BACKWARD) == [a_pass]
    assert look("find_batchable_model_passes", types.RequestType.FORWARD) == []
    a_step = store("a", types.RequestType.OPTIM_STEP)
    b_pass = store("b", types.RequestType.FORWARD_BACKWARD)  # after the look: next pass
    b_step = store("b", types.RequestType.OPTIM_STEP)
    assert look("find_batchable_sample") == []
    assert look("find_single_requests") == [a_step]  # b's step waits for b's gradient
    for request in (a_pass, a_step):
        done(request)
    # The next pass takes b's gradient, then its step.
    assert look("find_batchable_model_passes", types.RequestType.FORWARD_BACKWARD) == [b_pass]
    look("find_batchable_model_passes", types.RequestType.FORWARD)
    look("find_batchable_sample")
    assert look("find_single_requests") == [b_step]


def test_an_unload_waits_for_the_models_samples_held_back_for_a_batch_of_their_own(looks):
    store, look, done = looks
    a_sample = store("a", types.RequestType.SAMPLE)
    b_sample = store("b", types.RequestType.SAMPLE)
    b_unload = store("b", types.RequestType.UNLOAD_MODEL)
    look("find_batchable_model_passes", types.RequestType.FORWARD_BACKWARD)
    look("find_batchable_model_passes", types.RequestType.FORWARD)
    assert look("find_batchable_sample") == [a_sample]  # `one-adapter-batches`: b's in a batch of its own
    assert look("find_single_requests") == []
    done(a_sample)
    look("find_batchable_model_passes", types.RequestType.FORWARD_BACKWARD)
    look("find_batchable_model_passes", types.RequestType.FORWARD)
    assert look("find_batchable_sample") == [b_sample]
    assert look("find_single_requests") == [b_unload]
