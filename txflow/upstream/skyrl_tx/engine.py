"""Rank 0, the engine (which hosts the JAX coordinator): `self-gated-startup` (it waits for the API's
tables), `broadcast-delete-model` (unloads reach the workers), its end of `wake-channel` (wakes to and from
the API), of `load-optimizer-flag` (a state load restores the optimizer only when the client asked),
`tinker-sampler-paths` (sampler paths as Tinker's), `prompt-logprobs` (prompt logprobs as Tinker's),
`one-adapter-batches` (every batch holds one adapter's requests), `full-sampling-batches` (a sampling batch with
room waits for the rest of a burst) and `requests-in-order` (a model's optimizer step after its gradients)."""

from __future__ import annotations

from txflow.upstream import wake
from txflow.upstream.skyrl_tx import ENGINE_MODULE, layout, ranks


def broadcast_delete_model() -> None:
    """Rank 0's backend tells the workers to free a deleted model's slot too (`broadcast-delete-model`)."""
    from tx.tinker.backends.jax import JaxBackend

    def delete_model(self, model_id: str) -> None:
        self._broadcast_and_call("delete_model", model_id=model_id)

    JaxBackend.delete_model = delete_model


def waits_for_tables(timeout_s: float = 300.0) -> None:
    """The engine's request loop starts once the API has created the database tables (`self-gated-startup`)."""
    import time

    from sqlalchemy import inspect
    from tx.tinker.engine import TinkerEngine

    upstream_run = TinkerEngine.run

    def run(self):
        deadline = time.monotonic() + timeout_s
        while not inspect(self.db_engine).has_table("futures"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Tinker API did not create the database tables within {timeout_s:.0f} s")
            time.sleep(0.1)
        return upstream_run(self)

    TinkerEngine.run = run


def loads_optimizer_when_asked() -> None:
    """A load_weights request restores the optimizer only with its `optimizer` flag (`load-optimizer-flag`); upstream's
    engine reads the request as `LoadWeightsInput`, which has no such field, and always restores both."""
    from tx.tinker import types
    from tx.tinker.engine import TinkerEngine

    upstream = TinkerEngine.process_single_request

    def process_single_request(self, request_type, model_id, request_data):
        if request_type != types.RequestType.LOAD_WEIGHTS:
            return upstream(self, request_type, model_id, request_data)
        load = types.LoadWeightsInput.model_validate(request_data)
        if not self.backend.has_model(model_id):
            raise ValueError("Model not loaded. Create the model before loading a checkpoint.")
        path = self.config.checkpoints_base / load.source_model_id / f"{load.checkpoint_id}.tar.gz"
        # A request stored without the flag came through upstream's route (tinker_compat's 6. left out),
        # which means both.
        self.backend.load_checkpoint(path, model_id, load_optimizer=request_data.get("optimizer", True))
        return types.LoadWeightsOutput(type="load_weights")

    TinkerEngine.process_single_request = process_single_request


def sampler_paths_as_tinkers() -> None:
    """save_weights_for_sampler answers `tinker://<model_id>/sampler_weights/<name>`, Tinker's form, where
    upstream answers `tinker://<model_id>/<name>` (`tinker-sampler-paths`)."""
    from tx.tinker.engine import TinkerEngine

    upstream = TinkerEngine.process_save_weights_for_sampler

    def process_save_weights_for_sampler(self, model_id, request_data):
        result = upstream(self, model_id, request_data)
        if result.path is not None:  # None: an ephemeral sampler, named by its sampling session
            result.path = layout.tinker_path(model_id, "sampler", layout.parse_tinker_path(result.path)[2])
        return result

    TinkerEngine.process_save_weights_for_sampler = process_save_weights_for_sampler


def prompt_logprobs_as_tinkers() -> None:
    """A sample's prompt logprobs hold one entry per prompt token, None for the first, which has no context
    (`prompt-logprobs`); upstream leaves that entry out, so entry i was the logprob of token i + 1."""
    from tx.tinker.engine import TinkerEngine

    upstream = TinkerEngine.process_sample

    def process_sample(self, requests):
        results = upstream(self, requests)
        for result in results.values():
            if getattr(result, "prompt_logprobs", None) is not None:
                result.prompt_logprobs = [None, *result.prompt_logprobs]
        return results

    TinkerEngine.process_sample = process_sample


FILL_QUIET_S = 0.05
"""How long a partial sampling batch of one request waits for another before it starts (`full-sampling-batches`).
A client's burst is not even: the SDK's first request on a new sampling client came ~30 ms before the rest on a
busy machine, and with 20 ms the engine sampled it alone (the nightly's evaluations ran 1 + 8 + 8 + 7 requests, the
lone one in a program of its own: 1.3 s a batch, 4-15 s to load or compile it). Every lone request waits this long:
100 ms cost a test of many one-at-a-time calls 13% of its time, 50 ms half that."""
BURST_QUIET_S = 0.15
"""How long a batch of several requests (a burst being stored) waits for the next one. The API stores a burst's
requests one after another, and on 2 cores, beside the engine's own reads, one of the demo's 32 evaluation requests
was stored 109 ms after the one before it (4 of 10 demo runs had such a gap): a batch that waited 50 ms for it would
sample it alone, a whole padded pass (4.8 s on SmolLM2)."""
FILL_LIMIT_S = 1.0
"""The longest a partial sampling batch waits in all, however the requests trickle in (32 requests took 0.4 s to
store on a busy machine)."""


def batches_of_one_adapter() -> None:
    """Every batch the engine runs holds one adapter's requests (`one-adapter-batches`). A sampling batch takes the
    first pending request's model and checkpoint (or the base model), and the others wait for a batch of their own.
    A forward or forward_backward batch of several models runs as one batch per model, in the order of their
    first requests, within the same pass: a model's optimizer step, taken in that pass after its gradients, must
    find them all.

    A batch of one adapter runs on that slot's view (`one-slot-gradient`), a batch of several on every slot, and in
    bfloat16 the two programs round a row's figures apart (SmolLM2: a sampled token's logprob 0.125-0.5 off, and
    then other greedy tokens). So a run computes what it would alone whatever its neighbours send: a restore check
    that compares a live sampler with its restored copy exactly holds on a shared cluster, and a sweep's members
    train as their runs alone. An evaluation's 32 greedy samples fill a sampling batch on their own
    (`sampling-rows`), and a training batch of three models' rows ran no faster than three batches
    (docs/performance.md)."""
    from tx.tinker import types
    from tx.tinker.engine import TinkerEngine, logger

    upstream_sample = TinkerEngine.find_batchable_sample

    def adapter(request) -> tuple[str, str]:
        model_id, data = request
        return (model_id, data.checkpoint_id) if data.checkpoint_id else ("", "")

    def find_batchable_sample(self, session):
        found = upstream_sample(self, session)
        first = next(iter(found.values()), None)
        return {key: request for key, request in found.items() if adapter(request) == adapter(first)}

    def per_model(upstream):
        def process(self, requests: dict) -> dict:
            models: dict[str, dict] = {}
            for key, request in requests.items():
                models.setdefault(request[0], {})[key] = request
            if len(models) == 1:
                return upstream(self, requests)
            results = {}
            for model_id, part in models.items():
                try:
                    results.update(upstream(self, part))
                except Exception as exc:  # this model's requests fail, as upstream fails a whole batch's
                    logger.exception(f"Error processing model {model_id}'s part of a batch: {exc}")
                    results.update({key: types.ErrorResponse(error=str(exc), status="failed") for key in part})
            return results

        return process

    TinkerEngine.find_batchable_sample = find_batchable_sample
    TinkerEngine.process_forward_backward = per_model(TinkerEngine.process_forward_backward)
    TinkerEngine.process_forward = per_model(TinkerEngine.process_forward)


def each_models_requests_in_order() -> None:
    """A model's single requests (an optimizer step, a save, a load, an unload) run after every request of that
    model that came before them (`requests-in-order`).

    Upstream's pass over the pending requests looks for model passes first, then for samples, then for single
    requests, each a read of its own, and runs them in that order. A forward_backward stored after the first look
    and an optimizer step stored after it, both before the last look, ran step before gradient: the step found no
    gradient and the next one took two. txflow's sampling look waits up to a second for a batch to fill
    (`full-sampling-batches`), long enough for a run training beside one that samples to lose an update so; and a
    sample held back for its own batch (`one-adapter-batches`) could meet its model already unloaded. Here the
    single requests of a model whose earlier requests this pass did not take wait for the next pass."""
    from sqlmodel import select
    from tx.tinker import types
    from tx.tinker.db_models import FutureDB, RequestStatus
    from tx.tinker.engine import TinkerEngine

    upstream_passes = TinkerEngine.find_batchable_model_passes
    upstream_samples = TinkerEngine.find_batchable_sample
    upstream_singles = TinkerEngine.find_single_requests
    ordered = (types.RequestType.FORWARD_BACKWARD, types.RequestType.FORWARD, types.RequestType.SAMPLE)

    def find_batchable_model_passes(self, session, request_type):
        found = upstream_passes(self, session, request_type)
        first_look = request_type == types.RequestType.FORWARD_BACKWARD  # of a pass
        self._txflow_taken = (set() if first_look else getattr(self, "_txflow_taken", set())) | set(found)
        return found

    def find_batchable_sample(self, session):
        found = upstream_samples(self, session)
        self._txflow_taken = getattr(self, "_txflow_taken", set()) | set(found)
        return found

    def find_single_requests(self, session):
        found = upstream_singles(self, session)
        taken = getattr(self, "_txflow_taken", set())
        waiting: dict[str, int] = {}  # each model's first request this pass left pending
        for model_id, request_id in session.exec(
                select(FutureDB.model_id, FutureDB.request_id).where(FutureDB.status == RequestStatus.PENDING)
                .where(FutureDB.request_type.in_(ordered))).all():
            if str(request_id) not in taken:
                waiting[model_id] = min(waiting.get(model_id, request_id), request_id)
        self._txflow_taken = set()
        return {key: request for key, request in found.items()
                if request[0] not in waiting or int(key) < waiting[request[0]]}

    TinkerEngine.find_batchable_model_passes = find_batchable_model_passes
    TinkerEngine.find_batchable_sample = find_batchable_sample
    TinkerEngine.find_single_requests = find_single_requests


def fills_sampling_batches() -> None:
    """A sampling batch with room left starts once its requests stop arriving (`full-sampling-batches`): upstream
    takes whatever is pending at the moment it looks, so a client's 32 evaluation samples, stored one after
    another over ~0.1 s, ran as 2 + 8 + 8 + 8 + 6 rows: five passes of a full batch's cost instead of four.

    The room is upstream's, `sample_max_num_sequences` requests, or, for requests whose rows are short
    (`ranks.rows_are_short`), as many requests as `sampling-rows`' larger batch has rows: a client's 32 greedy
    evaluation samples, one request each, are then one batch instead of four."""
    import time

    from sqlmodel import Session
    from tx.tinker.engine import TinkerEngine

    from txflow.upstream.skyrl_tx import ranks

    upstream = TinkerEngine.find_batchable_sample

    def short(requests) -> bool:
        return ranks.rows_are_short([sum(len(c.tokens) for c in r.prompt.chunks) for r in requests],
                                    [r.sampling_params.max_tokens for r in requests])

    def pick(self, session) -> dict:
        """Upstream's pick, of up to a larger batch's rows when the first requests are short."""
        config = self.backend.config
        rows = config.sample_max_num_sequences
        config.sample_max_num_sequences = room = rows * ranks.SAMPLE_ROWS_FACTOR
        try:
            found = list(upstream(self, session).items())
        finally:
            config.sample_max_num_sequences = rows
        taken, total = 0, 0
        while taken < len(found):
            request = found[taken][1][1]
            if total + request.num_samples > room or not short([r for _, (_, r) in found[:taken + 1]]):
                break
            taken, total = taken + 1, total + request.num_samples
        return dict(found[:taken] if taken > rows else found[:rows])  # else upstream's pick

    def room_left(self, found: dict) -> bool:
        rows = self.backend.config.sample_max_num_sequences
        requests = [request for _, request in found.values()]
        if short(requests):
            return sum(r.num_samples for r in requests) < rows * ranks.SAMPLE_ROWS_FACTOR
        return len(requests) < rows

    def find_batchable_sample(self, session):
        if self.backend.config.sample_max_num_sequences <= 0:  # no limit: upstream takes every pending request
            return upstream(self, session)
        found = pick(self, session)
        deadline = time.monotonic() + FILL_LIMIT_S
        quiet = 0.0  # since the batch last grew
        while found and room_left(self, found) and time.monotonic() < deadline:
            time.sleep(FILL_QUIET_S)
            with Session(self.db_engine) as fresh:  # a new read: the first session's snapshot is as it began
                more = pick(self, fresh)
            if len(more) > len(found):
                found, quiet = more, 0.0
                continue
            quiet += FILL_QUIET_S
            if quiet >= (FILL_QUIET_S if len(found) == 1 else BURST_QUIET_S) - 1e-9:
                break
        return found

    TinkerEngine.find_batchable_sample = find_batchable_sample


class _EngineClock:
    """What upstream's engine module sees as `time`. Its one `time.sleep`, the 0.1 s after each pass over
    the pending requests, ends early at the API's wake (`wake-channel`); everything else is the `time` module."""

    def __init__(self, channel):
        self._channel = channel

    def sleep(self, seconds: float) -> None:
        if self._channel.sleep(seconds):
            wake.say_once(self, "the API's wakes reach the engine")

    def __getattr__(self, name: str):
        import time

        return getattr(time, name)


def wakes(engine_module) -> None:
    """The engine's end of the wake channel (`wake-channel`): woken by new requests, waking the API once its
    results are committed."""
    channel = wake.Channel.from_env("engine", "api")
    if channel is None:
        return
    engine_module.time = _EngineClock(channel)
    upstream_complete = engine_module.TinkerEngine._complete_futures

    def _complete_futures(self, results):
        upstream_complete(self, results)
        channel.send()

    engine_module.TinkerEngine._complete_futures = _complete_futures


def run(argv: list[str]) -> None:
    """The engine with txflow's patches, on upstream's command line `argv`."""

    def patch(entry) -> None:
        waits_for_tables()
        broadcast_delete_model()
        loads_optimizer_when_asked()
        sampler_paths_as_tinkers()
        prompt_logprobs_as_tinkers()
        batches_of_one_adapter()  # before: the sampling batch it fills is of one adapter
        fills_sampling_batches()
        each_models_requests_in_order()  # after: it records the batches they chose
        wakes(entry)

    ranks.run(ENGINE_MODULE, argv, patch)
