"""The `rest-surface` change: the Tinker REST surface of SDK 0.13.1's `RestClient`, against a txflow cluster.

SkyRL-tx 0.3.0 serves training runs and their checkpoint lists, and an archive route that redirects to a download the
key check covers (`api-key-check`), for bare checkpoint names only: since the `tinker-sampler-paths` change the SDK asks
for `.../checkpoints/sampler_weights/<name>/archive`, which no route matched. Every other call of the `RestClient` got
404. `install(app, signer)` serves each call, or refuses it in one line (400) that names the txflow command doing its
job:

- archive URL: a 302 to a download URL signed for that one checkpoint (`auth.DownloadSigner`), both path
  forms, state checkpoints too (their one file, tarred); the download needs the key or that signature;
- `GET /checkpoints` (list_user_checkpoints), `GET /sessions`, `GET /sessions/{id}`: from the database;
- training runs with `last_checkpoint`/`last_sampler_checkpoint`, `get_info` with `lora_rank`;
- delete, publish/unpublish, a TTL (set_checkpoint_ttl, the saves' ttl_seconds) and save_state's
  `overwrite`: refused. txflow commits every checkpoint to durable storage and its own rules decide what
  goes (`txflow prune`, crash-safe, marker first) and what is published (promotion); a deletion or an
  expiry that touched only the engine's copy would say "deleted" of a checkpoint that lives on;
- a reused checkpoint name: 400 in one line (upstream's answer was a 500 on SQLite, retried by the SDKs).
- external weights (0.38: `save_weights_external`, `get_external_weights_urls`, what its `tinker checkpoint
  download` uses): a sampler save under `EXTERNAL` + the name, its files signed one by one; a TTL and a delete
  apply to exports only;
- what the SDKs call on Tinker's hosted service (billing, audit log, projects, session traces and search,
  copy_weights, server-side custom losses, the CLI's login key check): refused in one line (`NOT_SERVED`).

Can go when upstream serves the REST surface and signs its download URLs.
"""

from __future__ import annotations

import io
import tarfile
import time
from datetime import UTC, datetime

from fastapi import HTTPException, Request, Response
from fastapi.responses import RedirectResponse
from fastapi.routing import APIRoute

from txflow.upstream.skyrl_tx import layout, served

RUNS = "/api/v1/training_runs"
KINDS = {"weights": "state", "sampler_weights": "sampler"}
DELETE_REFUSED = ("checkpoints of a txflow cluster are not deleted through the Tinker API: txflow keeps a durable "
                  "copy of each; delete old ones with `txflow prune ROOT` (it never removes a run's newest state)")
PUBLISH_REFUSED = ("publishing is not served by a txflow cluster: a run publishes its proven adapter with `txflow run "
                   "... --promote-as NAME` (see `txflow promoted ROOT NAME`)")
TTL_REFUSED = ("checkpoint expiry is not served by a txflow cluster: remove old checkpoints with `txflow prune ROOT "
               "--older-than DAYS`")
# What SDKs from 0.25 call for Tinker's hosted service (accounts, billing, projects, traces) or for storage a txflow
# cluster does not have: one line each instead of a bare 404 "Not Found", which the SDK's CLI would print as it is.
NO_ACCOUNTS = "a txflow cluster has no accounts: clients authenticate with the run's API key (TINKER_API_KEY)"
NOT_SERVED = {
    "billing": "billing is not served by a txflow cluster (self-hosted: no usage is charged)",
    "audit": "audit logs are not served by a txflow cluster (it has no accounts); a run's record is its report "
             "(`txflow run ... --json`)",
    "project": "projects are not served by a txflow cluster (it has no accounts)",
    "trace": "session traces are not served by a txflow cluster: a run's logs are under its state directory, logs/",
    "search": "session search is not served by a txflow cluster: list_sessions and get_session are",
    "copy": "copying checkpoints is not served by a txflow cluster: a run commits each checkpoint it saves to its "
            "durable storage (`--checkpoints`)",
    "custom_loss": "server-side custom losses are not served by a txflow cluster: use forward_backward_custom (the "
                   "loss runs in the client)",
    "encrypted": "age-encrypted external weights are not served by a txflow cluster: export without "
                 "age_encryption_recipients",
    "accounts": NO_ACCOUNTS,
}
OVERWRITE_REFUSED = ("save_state(overwrite=True) is not served by a txflow cluster (a committed checkpoint is never "
                     "replaced): save under a new name")


def install(app, signer) -> None:
    """Serve the routes on SkyRL-tx's FastAPI `app`, in place of upstream's where it has one; `signer` signs
    download URLs (the key check verifies them)."""
    app.state.download_signer = signer
    routes = [
        ("GET", RUNS + "/{run_id}/checkpoints/{kind}/{name}/archive", archive_url),
        ("GET", RUNS + "/{unique_id}/checkpoints/{checkpoint_id}/archive", archive_url_of_sampler),
        ("GET", RUNS + "/{run_id}/checkpoints/{kind}/{name}/download", download),
        ("DELETE", RUNS + "/{run_id}/checkpoints/{kind}/{name}", delete_checkpoint),
        ("DELETE", RUNS + "/{run_id}/checkpoints/{name}", refuse_delete),
        ("POST", RUNS + "/{run_id}/checkpoints/{kind}/{name}/publish", refuse_publish),
        ("DELETE", RUNS + "/{run_id}/checkpoints/{kind}/{name}/publish", refuse_publish),
        ("PUT", RUNS + "/{run_id}/checkpoints/{kind}/{name}/ttl", set_ttl),
        ("GET", "/api/v1/checkpoints", list_user_checkpoints),
        ("GET", "/api/v1/billing/usage/events", _refuse("billing")),
        ("GET", "/api/v1/billing/usage/checkpoints/current", _refuse("billing")),
        ("GET", "/api/v1/audit", _refuse("audit")),
        ("PUT", "/api/v1/sessions/{session_id}/project", _refuse("project")),
        ("GET", "/api/v1/sessions/{session_id}/trace_export", _refuse("trace")),
        ("POST", "/api/v1/sessions/search", _refuse("search")),
        ("POST", "/api/v1/copy_weights", _refuse("copy")),
        ("POST", "/api/v1/create_custom_loss", _refuse("custom_loss")),
        ("POST", "/api/v1/save_weights_external", save_weights_external),
        ("GET", RUNS + "/{run_id}/checkpoints/external_weights/{name}/external_weights_urls", external_weights_urls),
        ("GET", RUNS + "/{run_id}/checkpoints/external_weights/{name}/files/{file}", external_weights_file),
        ("GET", "/api/v1/auth/apikey/me", _refuse("accounts")),
        ("DELETE", "/api/v1/auth/apikey/me", _refuse("accounts")),
        ("GET", "/api/v1/sessions", list_sessions),
        ("GET", "/api/v1/sessions/{session_id}", get_session),
        ("GET", RUNS, list_training_runs),
        ("GET", RUNS + "/{model_id}", get_training_run),
        ("POST", "/api/v1/get_info", get_info),
        ("POST", "/api/v1/save_weights", save_weights),
        ("POST", "/api/v1/save_weights_for_sampler", save_weights_for_sampler),
    ]
    for method, path, endpoint in routes:
        app.router.routes[:] = [r for r in app.router.routes
                                if not (isinstance(r, APIRoute) and r.path == path and method in r.methods)]
        app.add_api_route(path, endpoint, methods=[method])


def _db(req: Request):
    from sqlmodel.ext.asyncio.session import AsyncSession

    return AsyncSession(req.app.state.db_engine)


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise HTTPException(status_code=404, detail=f"no checkpoint kind {kind!r}: weights or sampler_weights")
    return KINDS[kind]


async def _completed(req: Request, run_id: str, kind: str, name: str):
    """The checkpoint's file or directory on the engine's disk, once the database says it is complete."""
    from tx.tinker import api, types

    checkpoint_type = types.CheckpointType.TRAINING if kind == "state" else types.CheckpointType.SAMPLER
    async with _db(req) as session:
        await api.validate_checkpoint(req, run_id, name, checkpoint_type, session)  # 404 / 425 / 500 as upstream
    relative = layout.relative_checkpoint_path(layout.tinker_path(run_id, kind, name))
    return req.app.state.engine_config.checkpoints_base / relative


# --- archive URL and the signed download --------------------------------------------------------------


async def archive_url(run_id: str, kind: str, name: str, req: Request):
    """A 302 to this checkpoint's download URL, signed for it alone (what the SDK reads as the archive URL)."""
    await _completed(req, run_id, _kind(kind), name)
    path = f"{RUNS}/{run_id}/checkpoints/{kind}/{name}/download"
    query, expires = req.app.state.download_signer.sign(path)
    response = RedirectResponse(url=f"{str(req.base_url).rstrip('/')}{path}?{query}", status_code=302)
    response.headers["Expires"] = datetime.fromtimestamp(expires, UTC).strftime("%a, %d %b %Y %H:%M:%S GMT")
    return response


async def archive_url_of_sampler(unique_id: str, checkpoint_id: str, req: Request):
    """Upstream's form (a bare name is a sampler checkpoint)."""
    return await archive_url(unique_id, "sampler_weights", checkpoint_id, req)


async def download(run_id: str, kind: str, name: str, req: Request):
    """The checkpoint as a tar archive: a sampler's own gzip tarball, a state's directory tarred here."""
    import asyncio

    where = await _completed(req, run_id, _kind(kind), name)
    if KINDS[kind] == "sampler":
        body = await asyncio.to_thread(where.read_bytes)
    else:
        body = await asyncio.to_thread(_tar, where)
    return Response(body, media_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="{run_id}_{kind}_{name}.tar"'})


def _tar(directory) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(directory.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(directory)), recursive=False)
    return buffer.getvalue()


# --- refused: delete, publish, TTL ----------------------------------------------------------------------


def _refuse(what: str):
    """An endpoint answering 400 with `NOT_SERVED[what]`, whatever the path's parameters."""
    async def refuse(req: Request):
        raise HTTPException(status_code=400, detail=NOT_SERVED[what])

    refuse.__name__ = f"refuse_{what}"
    return refuse


async def refuse_delete(run_id: str, name: str, kind: str | None = None):
    raise HTTPException(status_code=400, detail=DELETE_REFUSED)


async def refuse_publish(run_id: str, kind: str, name: str):
    raise HTTPException(status_code=400, detail=PUBLISH_REFUSED)


async def set_ttl(run_id: str, kind: str, name: str, request: dict, req: Request):
    """A TTL applies to an external-weights export (which this process deletes when it expires), not to a
    checkpoint: txflow's prune rules decide when those go."""
    if kind != "external_weights":
        raise HTTPException(status_code=400, detail=TTL_REFUSED)
    await _completed(req, run_id, "sampler", EXTERNAL + name)
    ttl = request.get("ttl_seconds")
    if ttl is not None and (not isinstance(ttl, int) or ttl <= 0):
        raise HTTPException(status_code=400, detail="ttl_seconds: a positive number of seconds, or null for none")
    _expiry(req)[(run_id, name)] = None if ttl is None else time.time() + ttl
    await _delete_expired_exports(req)
    return None


async def delete_checkpoint(run_id: str, kind: str, name: str, req: Request):
    """An external-weights export is deleted; a checkpoint is refused (`DELETE_REFUSED`)."""
    if kind != "external_weights":
        raise HTTPException(status_code=400, detail=DELETE_REFUSED)
    await _completed(req, run_id, "sampler", EXTERNAL + name)
    await _delete_export(req, run_id, name)
    return None


# --- external weights: an export of the adapter in PEFT format, and its signed files -----------------------
#
# `tinker checkpoint download` of SDK 0.38 downloads a training checkpoint this way: it loads the state into a new
# training client, saves it as external weights with a TTL, asks for one signed URL per file, renews the TTL, and
# deletes the export. Here an export is a sampler save under `EXTERNAL` + its name (SkyRL-tx writes adapters in
# PEFT format for its sampler), served as `tinker://<run>/external_weights/<name>`. txflow does not commit exports
# to durable storage (`layout.is_ephemeral_sampler`): they are copies, and go when deleted or when their TTL ends.

EXTERNAL = layout.EXTERNAL_PREFIX


def _expiry(req: Request) -> dict:
    if not hasattr(req.app.state, "external_expiry"):
        req.app.state.external_expiry = {}
    return req.app.state.external_expiry


async def _delete_export(req: Request, run_id: str, name: str) -> None:
    import asyncio

    from tx.tinker import types
    from tx.tinker.db_models import CheckpointDB

    async with _db(req) as session:
        row = await session.get(CheckpointDB, (run_id, EXTERNAL + name, types.CheckpointType.SAMPLER))
        if row is not None:
            await session.delete(row)
            await session.commit()
    where = req.app.state.engine_config.checkpoints_base / layout.relative_checkpoint_path(
        layout.tinker_path(run_id, "sampler", EXTERNAL + name))
    await asyncio.to_thread(where.unlink, missing_ok=True)
    _expiry(req).pop((run_id, name), None)


async def _delete_expired_exports(req: Request) -> None:
    now = time.time()
    for (run_id, name), expires in list(_expiry(req).items()):
        if expires is not None and expires < now:
            await _delete_export(req, run_id, name)


async def save_weights_external(request: dict, req: Request):
    """A sampler save under the export's name; its future's result is rewritten to an external-weights path
    (`external_result`)."""
    from tx.tinker import api

    if request.get("age_encryption_recipients"):
        raise HTTPException(status_code=400, detail=NOT_SERVED["encrypted"])
    name = request.get("path")
    if not isinstance(name, str) or not name:
        raise HTTPException(status_code=400, detail="save_weights_external needs a path (the export's name)")
    parsed = _validated(api.SaveWeightsForSamplerRequest, {"model_id": request.get("model_id"),
                                                            "path": EXTERNAL + name})
    await _delete_expired_exports(req)
    async with _db(req) as session:
        await _refuse_reused_name(session, parsed.model_id, parsed.path, "sampler")
        answer = await api.save_weights_for_sampler(parsed, session)
    ttl = request.get("ttl_seconds")
    _expiry(req)[(parsed.model_id, name)] = None if ttl is None else time.time() + ttl
    return answer


def external_result(result):
    """A finished sampler save under an export's name, as the SDK reads `save_weights_external`'s result."""
    if isinstance(result, dict) and result.get("type") == "save_weights_for_sampler":
        try:
            model_id, _, name = layout.parse_tinker_path(result.get("path") or "")
        except ValueError:
            return result
        if name.startswith(EXTERNAL):
            return {"path": f"tinker://{model_id}/external_weights/{name.removeprefix(EXTERNAL)}",
                    "type": "save_weights_external"}
    return result


def _members(tarball) -> dict[str, bytes]:
    with tarfile.open(tarball) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


async def external_weights_urls(run_id: str, name: str, req: Request):
    """One URL per file of the export, each signed for that file alone; they expire with the signer's TTL."""
    import asyncio

    await _delete_expired_exports(req)
    tarball = await _completed(req, run_id, "sampler", EXTERNAL + name)
    files = await asyncio.to_thread(_members, tarball)
    urls, expires = {}, 0
    for file in sorted(files):
        path = f"{RUNS}/{run_id}/checkpoints/external_weights/{name}/files/{file}"
        query, expires = req.app.state.download_signer.sign(path)
        urls[file] = f"{str(req.base_url).rstrip('/')}{path}?{query}"
    return {"urls": urls, "expires": datetime.fromtimestamp(expires or time.time(), UTC).isoformat()}


async def external_weights_file(run_id: str, name: str, file: str, req: Request):
    import asyncio

    tarball = await _completed(req, run_id, "sampler", EXTERNAL + name)
    files = await asyncio.to_thread(_members, tarball)
    if file not in files:
        raise HTTPException(status_code=404, detail=f"tinker://{run_id}/external_weights/{name} has no file {file!r}")
    return Response(files[file], media_type="application/octet-stream")


def _validated(model, request: dict):
    """`request` as upstream's request `model`; a 422 as FastAPI answers one when it does not fit."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    try:
        return model.model_validate(request)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


async def save_weights(request: dict, req: Request):
    """Upstream's save_weights, refusing in one line what it would drop: a TTL and `overwrite`."""
    from tx.tinker import api

    if request.get("ttl_seconds") is not None:
        raise HTTPException(status_code=400, detail=TTL_REFUSED)
    if request.get("overwrite"):
        raise HTTPException(status_code=400, detail=OVERWRITE_REFUSED)
    parsed = _validated(api.SaveWeightsRequest, request)
    async with _db(req) as session:
        await _refuse_reused_name(session, parsed.model_id, parsed.path, "state")
        return await api.save_weights(parsed, session)


async def _refuse_reused_name(session, model_id: str, name: str, kind: str) -> None:
    """400 in one line for a name the model has saved before. Upstream's own check runs after a failed insert
    and then reads through the failed transaction: on SQLite a 500; and the SDKs retry a 409 as they retry a
    500, for minutes, so the refusal is a 400."""
    from tx.tinker import types
    from tx.tinker.db_models import CheckpointDB

    checkpoint_type = types.CheckpointType.TRAINING if kind == "state" else types.CheckpointType.SAMPLER
    if await session.get(CheckpointDB, (model_id, name, checkpoint_type)) is not None:
        raise HTTPException(status_code=400, detail=f"{model_id} already has a {kind} checkpoint named {name!r}: "
                                                    f"save under a new name")


async def save_weights_for_sampler(request: dict, req: Request):
    """Upstream's save_weights_for_sampler, refusing a TTL in one line instead of dropping it."""
    from tx.tinker import api

    if request.get("ttl_seconds") is not None:
        raise HTTPException(status_code=400, detail=TTL_REFUSED)
    parsed = _validated(api.SaveWeightsForSamplerRequest, request)
    async with _db(req) as session:
        if parsed.path:
            await _refuse_reused_name(session, parsed.model_id, parsed.path, "sampler")
        return await api.save_weights_for_sampler(parsed, session)


# --- listings: checkpoints, sessions, training runs, get_info ----------------------------------------------


def _checkpoint(row) -> dict:
    from tx.tinker import types

    kind = "state" if row.checkpoint_type == types.CheckpointType.TRAINING else "sampler"
    return {"checkpoint_id": row.checkpoint_id, "checkpoint_type": row.checkpoint_type.value,
            "time": row.completed_at or row.created_at, "tinker_path": layout.tinker_path(row.model_id, kind,
                                                                                          row.checkpoint_id),
            "public": False, "expires_at": None}


async def list_user_checkpoints(req: Request, limit: int = 100, offset: int = 0):
    """Every completed checkpoint the engine knows, newest first."""
    from sqlmodel import func, select
    from tx.tinker.db_models import CheckpointDB, CheckpointStatus

    completed = CheckpointDB.status == CheckpointStatus.COMPLETED
    async with _db(req) as session:
        total = (await session.exec(select(func.count()).select_from(CheckpointDB).where(completed))).one()
        rows = (await session.exec(select(CheckpointDB).where(completed)
                                   .order_by(CheckpointDB.completed_at.desc()).offset(offset).limit(limit))).all()
    return {"checkpoints": [_checkpoint(row) for row in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


async def list_sessions(req: Request, limit: int = 20, offset: int = 0):
    from sqlmodel import select
    from tx.tinker.db_models import SessionDB

    async with _db(req) as session:
        rows = (await session.exec(select(SessionDB.session_id).order_by(SessionDB.created_at.desc())
                                   .offset(offset).limit(limit))).all()
    return {"sessions": list(rows)}


async def get_session(session_id: str, req: Request):
    """The session's training runs (models) and sampling sessions."""
    from sqlmodel import select
    from tx.tinker.db_models import ModelDB, SamplingSessionDB, SessionDB

    async with _db(req) as session:
        if await session.get(SessionDB, session_id) is None:
            raise HTTPException(status_code=404, detail="Session not found")
        models = (await session.exec(select(ModelDB.model_id).where(ModelDB.session_id == session_id))).all()
        samplers = (await session.exec(select(SamplingSessionDB.sampling_session_id)
                                       .where(SamplingSessionDB.session_id == session_id))).all()
    return {"training_run_ids": list(models), "sampler_ids": list(samplers)}


async def _training_run(session, model) -> dict:
    """Upstream's training run, with its newest checkpoint of each kind."""
    from sqlmodel import select
    from tx.tinker import types
    from tx.tinker.db_models import CheckpointDB, CheckpointStatus

    def newest(checkpoint_type):
        return (select(CheckpointDB).where(CheckpointDB.model_id == model.model_id,
                                           CheckpointDB.checkpoint_type == checkpoint_type,
                                           CheckpointDB.status == CheckpointStatus.COMPLETED)
                .order_by(CheckpointDB.completed_at.desc()).limit(1))

    state = (await session.exec(newest(types.CheckpointType.TRAINING))).first()
    sampler = (await session.exec(newest(types.CheckpointType.SAMPLER))).first()
    return {"training_run_id": model.model_id, "base_model": model.base_model, "model_owner": "default",
            "is_lora": True, "corrupted": False, "lora_rank": model.lora_config["rank"],
            "last_request_time": model.created_at, "user_metadata": None,
            "last_checkpoint": _checkpoint(state) if state else None,
            "last_sampler_checkpoint": _checkpoint(sampler) if sampler else None}


async def get_training_run(model_id: str, req: Request):
    from tx.tinker import api

    async with _db(req) as session:
        return await _training_run(session, await api.get_model(session, model_id))


async def list_training_runs(req: Request, limit: int = 20, offset: int = 0):
    """Newest first: `tinker run list` shows the first page (20) by default."""
    from sqlmodel import func, select
    from tx.tinker.db_models import ModelDB

    async with _db(req) as session:
        total = (await session.exec(select(func.count()).select_from(ModelDB))).one()
        models = (await session.exec(select(ModelDB).order_by(ModelDB.created_at.desc()).offset(offset)
                                  .limit(limit))).all()
        runs = [await _training_run(session, model) for model in models]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


async def get_info(request: dict, req: Request):
    """Upstream's get_info, with the fields the SDK's `GetInfoResponse` reads: `lora_rank`, `is_lora`,
    `model_name`."""
    from tx.tinker import api

    model_id = request.get("model_id")
    if not isinstance(model_id, str):
        raise HTTPException(status_code=400, detail="get_info needs a model_id")
    async with _db(req) as session:
        model = await api.get_model(session, model_id)
    rank = model.lora_config["rank"]
    return {"type": "get_info", "model_id": model.model_id, "status": model.status, "is_lora": rank > 0,
            "lora_rank": rank, "model_name": model.base_model,
            "model_data": {"base_model": model.base_model, "model_name": model.base_model,
                           "tokenizer_id": served.served(req).tokenizer_id(model.base_model),
                           "lora_config": {"rank": rank}}}
