"""The served model, by each name a client may pass for it.

SkyRL-tx 0.3.0 lists its base model under one name, the path or hub id the engine loaded
(`get_server_capabilities`), stores whatever `base_model` a client sends, and answers `get_info` and the
sampler route with it. A client written for another Tinker server passes the model's Hugging Face id (or
txflow's name for it, `smollm2-135m`), checks that the server lists that name, and loads the tokenizer by the
name the server answers (`get_tokenizer()`): with a hub id on a machine without internet that fails, and a
name the server does not serve trained the served model anyway.

Here the cluster serves its model under every name it has (`ServedModel.names`: the Hugging Face id, the name
the run gave, the loaded path), refuses any other `base_model` in one line naming them, and answers the
tokenizer with the loaded directory (`tokenizer_id` in `get_info`, the sampler's `base_model`), which loads
offline. Can go when upstream lists aliases and answers a tokenizer id.
"""

from __future__ import annotations

import os

from fastapi import HTTPException, Request
from pydantic import BaseModel, ValidationError

SERVED_ENV = "TXFLOW_SERVED_MODEL"


class ServedModel(BaseModel, frozen=True):
    path: str  # what the engine loaded: a local directory (or a hub id as given)
    names: tuple[str, ...]  # every name a client may pass, the most portable first

    @classmethod
    def of(cls, requested: str, path: str, hf_id: str | None = None) -> ServedModel:
        """The names of a model a run asked for as `requested` and the engine loads from `path`."""
        names = [hf_id, requested, path]
        return cls(path=path, names=tuple(dict.fromkeys(n for n in names if n)))

    @classmethod
    def from_env(cls, loaded: str) -> ServedModel:
        """The API's served model: from the launcher's environment, else (started by hand) its one path."""
        text = os.environ.get(SERVED_ENV)
        return cls.model_validate_json(text) if text else cls(path=loaded, names=(loaded,))

    def env(self) -> dict[str, str]:
        return {SERVED_ENV: self.model_dump_json()}

    def check(self, base_model: str | None) -> None:
        """400 in one line unless `base_model` (when given) is a name of this model."""
        if base_model is not None and base_model not in self.names:
            raise HTTPException(status_code=400, detail=f"base_model {base_model!r} is not served by this cluster; "
                                                        f"it serves {', '.join(map(repr, self.names))}")

    def loaded(self, base_model: str | None) -> str | None:
        """The checked `base_model` as the engine knows it (its loaded path): the engine compares a base-model
        sample's name with its own."""
        self.check(base_model)
        return None if base_model is None else self.path

    def tokenizer_id(self, base_model: str | None) -> str | None:
        """What a client loads the tokenizer of `base_model` from: the loaded directory for any of our names."""
        return self.path if base_model in self.names else base_model


def served(req: Request) -> ServedModel:
    return req.app.state.served_model


def install(app, model: ServedModel) -> None:
    """Serve `get_server_capabilities` with every name, and check the name `create_sampling_session` is
    given (create_model checks its own: `lora_config.create_model`)."""
    from fastapi.routing import APIRoute

    app.state.served_model = model
    routes = {("GET", "/api/v1/get_server_capabilities"): get_server_capabilities,
              ("POST", "/api/v1/create_sampling_session"): create_sampling_session}
    app.router.routes[:] = [r for r in app.router.routes
                            if not (isinstance(r, APIRoute) and any(r.path == p and m in r.methods for m, p in routes))]
    for (method, path), endpoint in routes.items():
        app.add_api_route(path, endpoint, methods=[method])


async def get_server_capabilities(req: Request):
    return {"supported_models": [{"model_name": name} for name in served(req).names]}


async def create_sampling_session(request: dict, req: Request):
    """Upstream's create_sampling_session, refusing a base model this cluster does not serve; the session
    records the loaded path, which the engine expects and a client's tokenizer loads offline."""
    from fastapi.exceptions import RequestValidationError
    from sqlmodel.ext.asyncio.session import AsyncSession
    from tx.tinker import api

    try:
        parsed = api.CreateSamplingSessionRequest.model_validate(request)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    parsed.base_model = served(req).loaded(parsed.base_model)
    async with AsyncSession(req.app.state.db_engine) as session:
        return await api.create_sampling_session(parsed, session)
