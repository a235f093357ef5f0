"""The Tinker API server (the `external-engine`, `quiet-command-lines`, `sdk-shims`, `result-wait`, `lora-flags`,
`api-key-check` and `rest-surface` changes, and the API's end of `wake-channel` and `tinker-losses`): upstream's
FastAPI app, served without the engine spawn its lifespan would start through `uv`."""

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
    from txflow.upstream.skyrl_tx import auth, lora_config, losses, rest, served, tinker_compat

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
        channel = wake.Channel.from_env("api", "engine")  # (`wake-channel`)
        app.state.result_wakes = wake.AsyncWakes(channel, asyncio.get_running_loop()) if channel else None
        app.state.burst = Burst(channel.send) if channel else None
        yield
        if app.state.result_wakes:
            app.state.result_wakes.close()
        await app.state.db_engine.dispose()

    api.app.router.lifespan_context = lifespan
    _wake_engine_on_new_requests(api)
    api.app.add_middleware(BurstCount)
    tinker_compat.install(api.app)
    losses.install_api(api.app)  # (`tinker-losses`)
    lora_config.install_api(api.app)  # (`lora-flags`)
    served.install(api.app, served.ServedModel.from_env(engine_config.base_model))
    signer = auth.DownloadSigner()
    rest.install(api.app, signer)  # (`rest-surface`)
    # (`api-key-check`) last added, so it runs first; a shared cluster also lets in its attached runs' keys, each scoped
    auth.install(api.app, key, signer, os.environ.get(auth.RUN_KEYS_ENV) or None, auth.Limits.from_env())
    api.app.state.engine_config = engine_config
    config = uvicorn.Config(api.app, host=args.host, port=args.port, log_config=get_uvicorn_log_config())
    # The socket the launcher bound for this API and kept bound until now (txflow.processes.ports.listener):
    # no other local user can have taken the port. Without one (started by hand), bind --host/--port here.
    sock = ports.inherited_listener()
    if sock is not None:
        print(f"txflow: serving on the inherited socket {sock.getsockname()[0]}:{sock.getsockname()[1]} "
              f"(fd {sock.fileno()})", file=sys.stderr, flush=True)
    uvicorn.Server(config).run(sockets=[sock] if sock is not None else None)


# Upstream's routes that store a request for the engine (each calls `create_future`, then commits).
STORING_ROUTES = frozenset(f"/api/v1/{name}" for name in (
    "create_model", "unload_model", "forward_backward", "forward", "optim_step", "load_weights", "save_weights",
    "save_weights_for_sampler", "asample"))


class Burst:
    """Requests a client sends together (an RL step's samples, a step's forward_backward and optim_step) reach
    the engine in one wake (`wake-channel`): the wake after a stored request waits while another storing request is
    still being handled, and the last of them to finish sends it. A client that sends them together has them
    all in flight here at once, while the API stores them one after another (each a few database round
    trips): waking at each commit let the engine start on the first ones alone."""

    def __init__(self, send):
        self._send = send
        self.open = 0
        self.pending = False

    def stored(self) -> None:
        if self.open:
            self.pending = True
        else:  # committed outside a counted request (or after its response): wake now
            self._send()

    def started(self) -> None:
        self.open += 1

    def finished(self) -> None:
        self.open -= 1
        if not self.open and self.pending:
            self.pending = False
            self._send()


class BurstCount:
    """ASGI middleware: counts the storing requests in flight for `Burst` (only a path check for others)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        burst = getattr(scope["app"].state, "burst", None) if scope["type"] == "http" else None
        if burst is None or scope["method"] != "POST" or scope["path"] not in STORING_ROUTES:
            return await self.app(scope, receive, send)
        burst.started()
        try:
            return await self.app(scope, receive, send)
        finally:
            burst.finished()


def _wake_engine_on_new_requests(api) -> None:
    """Every request the API stores goes through upstream's `create_future`: once the session that
    stored one commits, wake the engine (`wake-channel`), once per burst of requests (`Burst`)."""
    from sqlalchemy import event

    upstream = api.create_future

    async def create_future(session, *args, **kwargs):
        request_id = await upstream(session, *args, **kwargs)
        burst = getattr(api.app.state, "burst", None)
        if burst:
            event.listen(session.sync_session, "after_commit", lambda _session: burst.stored(), once=True)
        return request_id

    api.create_future = create_future
