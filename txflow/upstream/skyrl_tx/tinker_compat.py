"""The Tinker API as the SDKs from 0.13 to 0.38 call it, served by SkyRL-tx 0.3.0.

SkyRL-tx 0.3.0 answers what `tinker` 0.13.1 sends. Newer SDKs call more endpoints
and speak protobuf on the hot paths. `install(app)` adds what they need to the
upstream FastAPI app, in the API process (`python -m txflow.upstream.skyrl_tx api`):
routes that wrap the upstream handlers or fill endpoints it lacks. No SDK is
patched and no SkyRL-tx file is changed: the client is the user's.

Upstream gaps filled here, the SDK versions that need each (found by running
them and reading their request code: `tinker/lib/internal_client_holder.py`,
`lib/api_future_impl.py`, `lib/public_interfaces/`, `resources/`, `proto/`):

1. `POST /api/v1/client/config` (0.25, 0.38). Every client fetches its feature
   flags before anything else. Without it: `ServiceClient` fails at its first
   call with a 404. We answer with the SDK's defaults, except that each feature
   this server lacks (JWT auth, zstd bodies, `retrieve_futures` polling,
   server-side custom losses, `join_sampling_session`, model creation through
   `load_weights`) is declared off, so a newer SDK whose default turns one on
   still takes the path we serve. Can go when upstream serves the handshake
   with the flags it supports (`skyrl` 0.4.0 serves a stub).
   It also turns the SDK's pyqwest transport off (`use_pyqwest_transport`, the
   switch Tinker keeps for a broken pyqwest), so 0.25 and 0.38 use httpx's own.
   pyqwest hands each response to asyncio from a tokio thread; one that lands
   while the client's interpreter exits takes the GIL during finalization, and
   Python (3.11 to 3.13) ends that thread with pthread_exit, which cannot
   unwind the Rust frames: glibc aborts the client silently, after its last
   line (docs/tinker-api.md, "The HTTP transport").
2. Protobuf `forward_backward` bodies (0.25, 0.38). The SDK posts
   `forward_backward` as `application/x-protobuf` and sends forward-only passes
   (`TrainingClient.forward`) to the same endpoint with `forward_only` set,
   never to `/api/v1/forward`. Without it: upstream cannot read the body as
   JSON (a 500), the SDK retries for 5 minutes, then the first
   `forward_backward` raises `InternalServerError`. We decode the body (text
   chunks, dense tensors) into upstream's JSON request and call upstream's
   `forward_backward` or `forward`. Can go when upstream reads protobuf bodies
   (`skyrl` 0.4.0 does).
3. Protobuf results (0.25, 0.38). `retrieve_future` with `Accept:
   application/x-protobuf` must return `ForwardBackwardOutput` and
   `SampleResponse` as protobuf: these SDKs reject JSON for those types
   ("Server returned a JSON payload ... which this SDK version only supports
   as proto"). We encode upstream's result. Can go with 2.
4. `sample_sequence_ids` on `asample` futures (0.38). The SDK stamps each
   sampled sequence with an id the server issued with the future. Without it:
   every `sample` fails with "asample promises always carry
   sample_sequence_ids" (also against `skyrl` 0.4.0). We issue
   `<request_id>-<i>`, one per requested sample. Can go when upstream returns
   them. This route also reads the sampling parameters as every SDK's types
   allow them (the `sampling-params` change); left out, upstream's route
   answers.
5. `GET /api/v1/samplers/{sampler_id}` (0.38). A sampling client made from a
   model path (`create_sampling_client(model_path=...)`) asks for its base
   model first. Without it: 404 when that sampling client is created. Can go
   when upstream serves it (`skyrl` 0.4.0 does).
6. Session-addressed `load_weights` (0.38). `create_training_client_from_state`
   no longer creates a model first: it sends `load_weights` with `session_id`
   and `model_seq_id` and no `model_id`, and the client itself names the model
   `<session_id>:train:<model_seq_id>`. Without it: 422, no restore. We create
   that model with the checkpoint owner's base model and LoRA config, then
   queue the load behind it. Can go when upstream creates models on load
   (`skyrl` 0.4.0 does not). This route also carries every load's `optimizer`
   flag to the engine (the `load-optimizer-flag` change); left out, loads
   restore the optimizer whatever the client asked, as upstream.
7. `POST /api/v1/sessions/{session_id}/finish` (0.38). `ServiceClient.close()`,
   and leaving `with ServiceClient() as client:`, finish the session. Without
   it: the client raises a 404 at its very end. We acknowledge it; the engine
   frees the session's adapters when its heartbeats stop
   (`--session-timeout-sec`), as for every client. Can go when upstream serves it.

`TXFLOW_TINKER_COMPAT_SKIP=3,4` leaves the named shims out, to show what breaks
without one.
"""

from __future__ import annotations

import os
import sys

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from txflow.upstream.skyrl_tx import rest, served
from txflow.upstream.skyrl_tx.protobuf import (
    encode_forward_backward_output,
    encode_sample_output,
    parse_forward_backward,
)

PROTO = "application/x-protobuf"
SKIP_ENV = "TXFLOW_TINKER_COMPAT_SKIP"

# 1. Flags a client may read; every feature named here is one this server does not have, but the transport.
CLIENT_CONFIG = {
    "use_pyqwest_transport": False,  # see the docstring: a client could abort at exit
    "pjwt_auth_enabled": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
    "create_model_via_load_weights": False,
}


def install(app) -> None:
    """Serve the shims on SkyRL-tx's FastAPI `app`, each in place of the upstream route it wraps."""
    shims = {
        1: ("POST", "/api/v1/client/config", client_config),
        2: ("POST", "/api/v1/forward_backward", forward_backward),
        3: ("POST", "/api/v1/retrieve_future", retrieve_future),
        4: ("POST", "/api/v1/asample", asample),
        5: ("GET", "/api/v1/samplers/{sampler_id}", get_sampler),
        6: ("POST", "/api/v1/load_weights", load_weights),
        7: ("POST", "/api/v1/sessions/{session_id}/finish", finish_session),
    }
    skip = {int(n) for n in os.environ.get(SKIP_ENV, "").replace(",", " ").split()}
    if skip & set(shims):  # said in the API's log: a cluster that serves less than the SDKs expect
        print(f"txflow: Tinker SDK shims left out ({SKIP_ENV}): {', '.join(map(str, sorted(skip & set(shims))))}",
              file=sys.stderr, flush=True)
    for number, (method, path, endpoint) in shims.items():
        if number in skip:
            continue
        app.router.routes[:] = [r for r in app.router.routes
                                if not (isinstance(r, APIRoute) and r.path == path and method in r.methods)]
        app.add_api_route(path, endpoint, methods=[method])


def _db(req: Request):
    from sqlmodel.ext.asyncio.session import AsyncSession

    return AsyncSession(req.app.state.db_engine)


# --- 1. the client_config handshake --------------------------------------------


async def client_config():
    return CLIENT_CONFIG


# --- 2. protobuf forward_backward requests ---------------------------------------


async def forward_backward(req: Request):
    """Upstream's forward_backward, or forward when a protobuf body says `forward_only`."""
    from tx.tinker import api

    body = await req.body()
    forward_only = False
    try:
        if req.headers.get("content-type", "").split(";")[0].strip().lower() == PROTO:
            fields, forward_only = parse_forward_backward(body)
            request = api.ForwardBackwardRequest.model_validate(fields)
        else:
            request = api.ForwardBackwardRequest.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    except ValueError as exc:
        raise HTTPException(status_code=400, detail=f"Unreadable protobuf forward_backward body: {exc}") from None
    async with _db(req) as session:
        if forward_only:
            return await api.forward(
                api.ForwardRequest(model_id=request.model_id, forward_input=request.forward_backward_input), session)
        return await api.forward_backward(request, session)


# --- 3. protobuf results -----------------------------------------------------------


async def retrieve_future(request: dict, req: Request):
    """Upstream's result, noticed sooner (the `result-wait` change); as protobuf for forward, forward_backward and
    sample when the client asks."""
    from tx.tinker import api, types

    from txflow.upstream.skyrl_tx.result_wait import wait_for_future

    try:
        retrieve = api.RetrieveFutureRequest.model_validate(request)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    future = await wait_for_future(retrieve.request_id, req)
    # A sampler save made for save_weights_external reads as that call's result (the `rest-surface` change).
    result, request_type = rest.external_result(future.result_data), future.request_type
    if PROTO not in req.headers.get("accept", ""):
        return result
    if request_type in (types.RequestType.FORWARD, types.RequestType.FORWARD_BACKWARD):
        return Response(encode_forward_backward_output(result), media_type=PROTO)
    if request_type == types.RequestType.SAMPLE:
        return Response(encode_sample_output(result), media_type=PROTO)
    return result


# --- 4. sample_sequence_ids ----------------------------------------------------------


# Sampling options of the SDKs (0.13 to 0.38) that SkyRL-tx 0.3.0 does not compute: a request that sets
# one is refused (the `sampling-params` change); upstream would accept it and answer without.
UNSERVED_SAMPLING = ("topk_prompt_logprobs", "topk_sample_logprobs", "target_prompt_logprobs", "prompt_alt_tokens_k",
                     "prompt_logprobs_last_n", "record_stability_info")


def sample_request(request: dict):
    """The SDK's sample request as upstream's `SampleRequest`: `stop` as the SDK's types allow it (a string,
    strings or token ids), what cannot be served refused in one line (the `sampling-params` change)."""
    from tx.tinker import api

    asked = [name for name in UNSERVED_SAMPLING if request.get(name)]
    if asked:
        raise HTTPException(status_code=400, detail=(
            f"{', '.join(asked)}: not served by this cluster (SkyRL-tx 0.3.0 returns the sampled tokens' logprobs "
            f"and, with prompt_logprobs=True, each prompt token's own); leave {'them' if len(asked) > 1 else 'it'} "
            f"at the default"))
    params = request.get("sampling_params")
    if isinstance(params, dict) and isinstance(params.get("stop"), str):
        request = {**request, "sampling_params": {**params, "stop": [params["stop"]]}}
    try:
        return api.SampleRequest.model_validate(request)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


async def asample(request: dict, req: Request):
    """Upstream's asample future, carrying one sequence id per requested sample."""
    from tx.tinker import api

    sample = sample_request(request)
    sample.base_model = served.served(req).loaded(sample.base_model)
    async with _db(req) as session:
        future = await api.asample(sample, req, session)
    ids = [f"{future.request_id}-{i}" for i in range(sample.num_samples)]
    return {**future.model_dump(), "sample_sequence_ids": ids}


# --- 5. samplers ---------------------------------------------------------------------


async def get_sampler(sampler_id: str, req: Request):
    """A sampling session's base model (what the SDK loads a tokenizer for) and model path."""
    from tx.tinker import api, types
    from tx.tinker.db_models import SamplingSessionDB

    async with _db(req) as session:
        sampler = await session.get(SamplingSessionDB, sampler_id)
        if sampler is None:
            raise HTTPException(status_code=404, detail=f"Sampler {sampler_id} not found")
        base_model = sampler.base_model
        if base_model is None:
            path = types.TinkerPath.parse(sampler.model_path or "")
            if path is None:
                raise HTTPException(status_code=500, detail=f"Sampler {sampler_id} has no usable model path")
            base_model = (await api.get_model(session, path.primary_id)).base_model
    # The SDK loads the tokenizer by this name alone: the loaded directory, for any name of the served model.
    base_model = served.served(req).tokenizer_id(base_model)
    return {"sampler_id": sampler_id, "base_model": base_model, "model_path": sampler.model_path}


# --- 6. session-addressed load_weights --------------------------------------------------


class LoadWeightsRequest(BaseModel):
    """A load_weights request with the flag upstream's `LoadWeightsRequest` drops (the `load-optimizer-flag` change)."""

    model_id: str
    path: str
    optimizer: bool = False  # Tinker's `load_state`: weights only; every SDK sends the flag


class LoadWeightsInput(BaseModel):
    """Upstream's `LoadWeightsInput` (what the engine reads) and the flag (the `load-optimizer-flag` change)."""

    source_model_id: str
    checkpoint_id: str
    optimizer: bool


async def load_weights(request: dict, req: Request):
    """Upstream's load_weights, carrying the client's `optimizer` flag to the engine (the `load-optimizer-flag` change);
    without a `model_id`, first create the model the client named."""
    from tx.tinker import api, types

    model_id = request.get("model_id")
    try:
        if model_id is None:
            model_id = await _create_model_to_load(request, req)
        load = LoadWeightsRequest.model_validate({**request, "model_id": model_id})
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    path = types.TinkerPath.parse(load.path)
    if path is None or path.kind != "weights" or not path.primary_id or not path.secondary_id:
        raise HTTPException(status_code=400,
                            detail="request.path must be in format tinker://source_model_id/weights/checkpoint_id")
    async with _db(req) as session:
        # Upstream's load_weights, with the flag in the stored request.
        await api.get_model(session, load.model_id)
        await api.validate_checkpoint(req, path.primary_id, path.secondary_id, types.CheckpointType.TRAINING, session)
        request_id = await api.create_future(
            session, types.RequestType.LOAD_WEIGHTS, load.model_id,
            LoadWeightsInput(source_model_id=path.primary_id, checkpoint_id=path.secondary_id,
                             optimizer=load.optimizer))
        await session.commit()
    return api.FutureResponse(future_id=str(request_id), status="pending", request_id=str(request_id))


async def _create_model_to_load(request: dict, req: Request) -> str:
    """Create `<session_id>:train:<model_seq_id>` like the checkpoint's own model; returns its id."""
    from tx.tinker import api, types
    from tx.tinker.db_models import ModelDB, SessionDB

    session_id, seq = request.get("session_id"), request.get("model_seq_id")
    if not isinstance(session_id, str) or not isinstance(seq, int):
        raise HTTPException(status_code=400, detail="load_weights needs a model_id, or a session_id and a model_seq_id")
    path = types.TinkerPath.parse(str(request.get("path", "")))
    if path is None or path.kind != "weights":
        raise HTTPException(status_code=400, detail="path must be tinker://<model_id>/weights/<checkpoint_id>")
    model_id = f"{session_id}:train:{seq}"
    async with _db(req) as session:
        if await session.get(ModelDB, model_id) is not None:  # a retry of this same request
            return model_id
        if await session.get(SessionDB, session_id) is None:
            raise HTTPException(status_code=404, detail="Session not found")
        source = await api.get_model(session, path.primary_id)
        await api.validate_checkpoint(req, path.primary_id, path.secondary_id, types.CheckpointType.TRAINING, session)
        lora_config = types.LoraConfig.model_validate(source.lora_config)
        # The same rows upstream's create_model writes, under the id the client chose.
        request_id = await api.create_future(session, types.RequestType.CREATE_MODEL, model_id,
                                             types.CreateModelInput(lora_config=lora_config))
        session.add(ModelDB(model_id=model_id, base_model=source.base_model, lora_config=lora_config.model_dump(),
                            status="created", request_id=request_id, session_id=session_id))
        await session.commit()
    return model_id


# --- 7. finishing a session -----------------------------------------------------------------


async def finish_session(session_id: str, req: Request):
    from tx.tinker.db_models import SessionDB

    async with _db(req) as session:
        if await session.get(SessionDB, session_id) is None:
            raise HTTPException(status_code=404, detail="Session not found")
    return {}
