"""The Tinker API server (points 1, 2, 10, 11, 14, 15, 20 and the API's end of 12 and 13): upstream's FastAPI app,
served without the engine spawn its lifespan would start through `uv`."""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import asynccontextmanager


def serve_api(argv: list[str]) -> None:
    """Run the upstream FastAPI app with a lifespan that does not spawn an engine."""
    import asyncio

    import uvicorn
    from sqlalchemy.ext.asyncio import create_async_engine
    from sqlmodel import SQLModel
    from tx.tinker import api
    from tx.tinker.config import EngineConfig, add_model
    from tx.tinker.db_models import enable_sqlite_wal, get_async_database_url
    from tx.utils.log import get_uvicorn_log_config

    from txflow.processes import ports
    from txflow.upstream import wake
    from txflow.upstream.skyrl_tx import auth, lora_config, losses, rest, tinker_compat

    parser = argparse.ArgumentParser(description="SkyRL-tx Tinker API without its engine spawn")
    add_model(parser, EngineConfig)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    key = os.environ.pop(auth.API_KEY_ENV, "")
    if not key:
        sys.exit(f"txflow: the Tinker API got no key to check ({auth.API_KEY_ENV}); it does not serve unprotected")
    engine_config = EngineConfig.model_validate({k: v for k, v in vars(args).items() if k in EngineConfig.model_fields})

    @asynccontextmanager
    async def lifespan(app):
        # Same database preparation as upstream's lifespan, minus the engine spawn.
        app.state.db_engine = create_async_engine(get_async_database_url(engine_config.database_url), echo=False)
        enable_sqlite_wal(app.state.db_engine.sync_engine)
        async with app.state.db_engine.begin() as conn:
            await conn.run_sync(SQLModel.metadata.create_all)
        app.state.external_inference_client = None
        channel = wake.Channel.from_env("api", "engine")  # (12.)
        app.state.result_wakes = wake.AsyncWakes(channel, asyncio.get_running_loop()) if channel else None
        yield
        if app.state.result_wakes:
            app.state.result_wakes.close()
        await app.state.db_engine.dispose()

    api.app.router.lifespan_context = lifespan
    _wake_engine_on_new_requests(api)
    tinker_compat.install(api.app)
    losses.install_api(api.app)  # (13.)
    lora_config.install_api(api.app)  # (14.)
    signer = auth.DownloadSigner()
    rest.install(api.app, signer)  # (20.)
    # (15.) last added, so it runs first; a shared cluster also lets in its attached runs' keys, each scoped
    auth.install(api.app, key, signer, os.environ.get(auth.RUN_KEYS_ENV) or None)
    api.app.state.engine_config = engine_config
    config = uvicorn.Config(api.app, host=args.host, port=args.port, log_config=get_uvicorn_log_config())
    # The socket the launcher bound for this API and kept bound until now (txflow.processes.ports.listener):
    # no other local user can have taken the port. Without one (started by hand), bind --host/--port here.
    sock = ports.inherited_listener()
    if sock is not None:
        print(f"txflow: serving on the inherited socket {sock.getsockname()[0]}:{sock.getsockname()[1]} "
              f"(fd {sock.fileno()})", file=sys.stderr, flush=True)
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)


def _wake_engine_on_new_requests(api) -> None:
    """Every request the API stores goes through upstream's `create_future`: once the session that
    stored one commits, wake the engine (12.)."""
    from sqlalchemy import event

    upstream = api.create_future

    async def create_future(session, *args, **kwargs):
        request_id = await upstream(session, *args, **kwargs)
        wakes = api.app.state.result_wakes
        if wakes:
            event.listen(session.sync_session, "after_commit", lambda _session: wakes.channel.send(), once=True)
        return request_id

    api.create_future = create_future
