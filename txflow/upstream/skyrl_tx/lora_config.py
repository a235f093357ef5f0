"""The `lora-flags` change: the LoRA configuration a client asks for is the one trained.

SkyRL-tx 0.3.0's `create_model` builds the adapter's LoraConfig from the request's rank and seed alone
(`tx/tinker/api.py`): `train_attn`, `train_mlp` and `train_unembed` are dropped, so every adapter trains
attention and MLP and never the unembedding, whatever the client asked (the Tinker SDK asks for all three
by default). The engine honours the flags once they reach it (`filter_lora`, on every rank: the config
travels with the create_model broadcast), so `install_api` serves create_model with them, and weights_info
answers them with the rank: SDKs up to 0.25 recreate a checkpoint's adapter from that answer
(`create_training_client_from_state`) and take True for every flag it leaves out. What the
engine cannot train is refused with one line instead: an adapter with no module. Can go when upstream's
create_model passes the flags on.

`train_unembed` on a base model whose output head is its input embedding (`tie_word_embeddings`: SmolLM2,
Llama-3.2, the small Qwen3s) trains the LoRA of that one shared matrix, on both ends (the `tied-head-lora` change,
`models.tied_head`): SkyRL-tx 0.3.0 applies no LoRA to a tied head (`LoRAEmbed.T`, "TODO: Apply lora adapters
here as well") and its `init_lora_adapter` refuses the flag on such a model; the Tinker SDK asks for it by
default.
"""

from __future__ import annotations

import random
from uuid import uuid4

from fastapi import Request
from pydantic import BaseModel, Field, ValidationError

from txflow.upstream.skyrl_tx import served


class LoraRequest(BaseModel):
    """A create_model request's LoRA config, as every Tinker SDK sends it (they send all three flags)."""

    rank: int = Field(ge=1)
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False  # upstream's default, for a client that leaves it out


class CreateModelRequest(BaseModel):
    session_id: str
    base_model: str
    lora_config: LoraRequest


def problem(lora: LoraRequest) -> str | None:
    """Why the engine cannot train this adapter on this base model, in one line; None when it can."""
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        return "train_attn, train_mlp and train_unembed are all False: the adapter would train nothing"
    return None


def install_api(app) -> None:
    """Serve create_model and weights_info with the flags (in place of upstream's routes)."""
    from fastapi.routing import APIRoute

    routes = {"/api/v1/create_model": create_model, "/api/v1/weights_info": weights_info}
    app.router.routes[:] = [r for r in app.router.routes if not (isinstance(r, APIRoute) and r.path in routes)]
    for path, endpoint in routes.items():
        app.add_api_route(path, endpoint, methods=["POST"])


async def create_model(request: dict, req: Request):
    """Upstream's create_model (the same rows, the same answer), with the LoRA flags the client asked for."""
    from fastapi import HTTPException
    from fastapi.exceptions import RequestValidationError
    from sqlmodel.ext.asyncio.session import AsyncSession
    from tx.tinker import api, types
    from tx.tinker.db_models import ModelDB, SessionDB

    try:
        parsed = CreateModelRequest.model_validate(request)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    lora = parsed.lora_config
    served.served(req).check(parsed.base_model)
    reason = problem(lora)
    if reason:
        raise HTTPException(status_code=400, detail=reason)
    async with AsyncSession(req.app.state.db_engine) as session:
        if await session.get(SessionDB, parsed.session_id) is None:
            raise HTTPException(status_code=404, detail="Session not found")
        model_id = f"model_{uuid4().hex[:8]}"
        seed = lora.seed if lora.seed is not None else random.randint(0, 2**31 - 1)
        # alpha 32, as upstream (the Tinker default it names); the flags are what upstream drops.
        config = types.LoraConfig(rank=lora.rank, alpha=32.0, seed=seed, train_attn=lora.train_attn,
                                  train_mlp=lora.train_mlp, train_unembed=lora.train_unembed)
        request_id = await api.create_future(session=session, request_type=types.RequestType.CREATE_MODEL,
                                             model_id=model_id, request_data=types.CreateModelInput(lora_config=config))
        session.add(ModelDB(model_id=model_id, base_model=parsed.base_model, lora_config=config.model_dump(),
                            status="created", request_id=request_id, session_id=parsed.session_id))
        await session.commit()
    return {"model_id": model_id, "base_model": parsed.base_model, "lora_config": lora.model_dump(),
            "status": "created", "request_id": str(request_id)}


async def weights_info(request: dict, req: Request):
    """Upstream's weights_info (base model, rank) with the LoRA flags of the checkpoint's model."""
    from fastapi.exceptions import RequestValidationError
    from sqlmodel.ext.asyncio.session import AsyncSession
    from tx.tinker import api, types

    try:
        parsed = api.WeightsInfoRequest.model_validate(request)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    async with AsyncSession(req.app.state.db_engine) as session:
        answer = await api.get_weights_info(parsed, req, session)  # its checks and its answer
        model = await api.get_model(session, types.TinkerPath.parse(parsed.tinker_path).primary_id)
    lora = types.LoraConfig.model_validate(model.lora_config)
    return {**answer.model_dump(), "train_attn": lora.train_attn, "train_mlp": lora.train_mlp,
            "train_unembed": lora.train_unembed}
