"""OpenAI's text API over a `Serving`: `/v1/models`, `/v1/completions` and `/v1/chat/completions`, streamed or
not, each request with the serving key (`Authorization: Bearer KEY`).

What the cluster's sampler can do is honoured (`max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `n`, the
sampled tokens' `logprobs`); what it cannot is refused in one line naming the parameter, never ignored (top
alternatives' logprobs, penalties, logit bias, tools, response formats, `suffix`, `best_of`). `echo` with
`logprobs` scores the prompt itself (each of its tokens' logprob), as evaluation harnesses ask. A stream
carries each choice whole in one chunk: the sampler answers a request at once, not token by token."""

from __future__ import annotations

import hmac
import json
import random
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from txflow.log import scrub
from txflow.serving.models import Serving
from txflow.training.tokenizer import chat_template, render_chat

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 256  # OpenAI's is the model's context; a bound a person notices beats a minute of sampling


class Refused(Exception):
    """A request this endpoint answers with an OpenAI-shaped error: (HTTP status, message, param, code)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # what OpenAI knows and we do not is refused by name, below

    model: str
    max_tokens: int | None = Field(default=None, ge=0)  # 0: only with `echo`, to score a prompt
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)


# Parameters the sampler has no way to honour: refused when set to anything but their neutral value.
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "tools": None, "tool_choice": None,
           "functions": None, "function_call": None, "response_format": None, "stream_options": None,
           "parallel_tool_calls": None, "prediction": None, "audio": None, "modalities": None,
           "reasoning_effort": None, "service_tier": None, "store": None, "metadata": None}


def _refuse_extras(request: BaseModel) -> None:
    for name, value in (request.model_extra or {}).items():
        if name in NEUTRAL and value in (NEUTRAL[name], None):
            continue
        if name in NEUTRAL:
            raise Refused(400, f"{name} is not supported: the cluster's sampler cannot honour it", name)
        raise Refused(400, f"unknown parameter {name}", name)


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise Refused(400, "stop: up to 4 non-empty strings", "stop")
    return stops


def _prompts(prompt) -> list[list[int]] | list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def _text_of(tokens: list[int], eos: int | None, stops: list[str], tokenizer) -> tuple[list[int], str, bool]:
    """The tokens up to the end of sequence, their text up to the first stop string (exclusive, as OpenAI
    answers), and whether either ended the choice."""
    ended = eos is not None and eos in tokens
    if ended:
        tokens = tokens[:tokens.index(eos)]
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    if cut >= 0:
        return tokens, text[:cut], True
    return tokens, text, ended


class Endpoint:
    """The routes, bound to what is served and to the key that opens them."""

    def __init__(self, serving: Serving, api_key: str):
        self.serving, self._key = serving, api_key
        self.eos = serving.tokenizer.eos_token_id

    def check_key(self, request: Request) -> None:
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), self._key.encode()):
            raise Refused(401, "a valid API key is needed (Authorization: Bearer KEY, the key `txflow serve` "
                               "printed)", code="invalid_api_key")

    def served(self, name: str):
        if name not in self.serving.models:
            raise Refused(404, f"model {name!r} is not served here; served: {', '.join(self.serving.models)}",
                          "model", "model_not_found")
        return self.serving.models[name]

    def sample(self, request: _Common, tokens: list[int], stops: list[str], default_max: int,
               prompt_logprobs: bool = False) -> tuple[list[dict], list[float | None] | None]:
        """`n` choices of the prompt `tokens`, each {tokens, text, logprobs, finish_reason}, and with
        `prompt_logprobs` the sampler's logprob of each prompt token (None for the first)."""
        from txflow.upstream.tinker_sdk import tinker

        served = self.served(request.model)
        asked = request.max_completion_tokens or request.max_tokens
        max_tokens = default_max if asked is None else asked
        drop = max_tokens == 0  # a prompt scored, nothing continued: the sampler draws one token, not shown
        max_tokens = max(max_tokens, 1)
        # Stop strings go to the engine (it stops at one); without any, the end of sequence is a stop token.
        # The engine takes one kind or the other, so an end of sequence after a stop string is cut here.
        stop = stops or ([self.eos] if self.eos is not None else None)
        params = tinker.types.SamplingParams(max_tokens=max_tokens, temperature=request.temperature,
                                             top_p=request.top_p, stop=stop,
                                             seed=request.seed if request.seed is not None
                                             else random.randrange(2**31 - 1024))
        handle = self.serving.handle
        try:
            future = served.sampler.sample(prompt=tinker.types.ModelInput.from_ints(tokens), num_samples=request.n,
                                           sampling_params=params, include_prompt_logprobs=prompt_logprobs)
            response = handle.wait(future, "a sample", self.serving.timeout_s)
        except Exception as exc:  # the cluster's own refusal (a bound, a dead rank): said, not hidden
            raise Refused(400 if "400" in str(exc) or "BadRequest" in type(exc).__name__ else 502,
                          f"the cluster refused or failed the sample: {scrub(str(exc))[:500]}") from None
        choices = []
        for seq in response.sequences:
            kept, text, stopped = _text_of([] if drop else list(seq.tokens), self.eos, stops, self.serving.tokenizer)
            logprobs = list(seq.logprobs or [])[:len(kept)]
            choices.append({"tokens": kept, "text": text, "logprobs": logprobs,
                            "finish_reason": "stop" if stopped or seq.stop_reason == "stop" else "length"})
        scored = None
        if prompt_logprobs:
            found = list(response.prompt_logprobs or [])
            scored = [None] + [float(lp) for lp in found[len(found) - (len(tokens) - 1):]] if tokens else []
        return choices, scored

    # --- routes ---------------------------------------------------------------------------------------------

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "txflow"}
                                           for name in self.serving.models]}

    def completions(self, request: CompletionRequest):
        _refuse_extras(request)
        if request.max_tokens == 0 and not request.echo:
            raise Refused(400, "max_tokens 0 is for scoring a prompt: give echo too", "max_tokens")
        if request.suffix:
            raise Refused(400, "suffix is not supported: the sampler continues a prompt, it does not fill in",
                          "suffix")
        if request.best_of not in (None, request.n):
            raise Refused(400, "best_of is not supported (ask for n choices and rank them)", "best_of")
        if request.logprobs is not None and request.logprobs > 1:
            raise Refused(400, "logprobs above 1 (top alternatives) is not supported: the sampler returns the "
                               "logprob of each sampled token only; ask for logprobs 0 or 1", "logprobs")
        stops = _stops(request.stop)
        tokenizer = self.serving.tokenizer
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for prompt in _prompts(request.prompt):
            tokens = tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
            usage["prompt_tokens"] += len(tokens)
            # `echo`: the prompt comes back before the completion, with the sampler's logprob of each of its
            # tokens (None for the first) when logprobs are asked: how a harness scores a text (loglikelihood).
            echo = request.echo and request.logprobs is not None
            choices_of, scored = self.sample(request, tokens, stops, COMPLETION_MAX_TOKENS, prompt_logprobs=echo)
            prompt_text = (prompt if isinstance(prompt, str) else tokenizer.decode(tokens)) if request.echo else ""
            for choice in choices_of:
                usage["completion_tokens"] += len(choice["tokens"])
                logprobs = None
                if request.logprobs is not None:
                    shown = (tokens if echo else []) + choice["tokens"]
                    values = (scored if echo else []) + choice["logprobs"]
                    pieces = [tokenizer.decode([t]) for t in shown]
                    offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
                    logprobs = {"tokens": pieces, "token_logprobs": values, "text_offset": offsets,
                                "top_logprobs": ([None if v is None else {p: v} for p, v in zip(pieces, values)]
                                                 if request.logprobs == 1 else None)}
                choices.append({"index": len(choices), "text": prompt_text + choice["text"], "logprobs": logprobs,
                                "finish_reason": choice["finish_reason"]})
        body = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": request.model, "choices": choices,
                "usage": {**usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}}
        if not request.stream:
            return body
        chunks = [{**body, "choices": [choice], "usage": None} for choice in choices]
        return _stream(chunks)

    def chat(self, request: ChatRequest):
        _refuse_extras(request)
        if request.top_logprobs:
            raise Refused(400, "top_logprobs above 0 is not supported: the sampler returns the logprob of each "
                               "sampled token only", "top_logprobs")
        tokenizer = self.serving.tokenizer
        if chat_template(tokenizer) is None:
            raise Refused(400, f"{request.model} has no chat template; use /v1/completions", "messages")
        messages = []
        for m in request.messages:
            content = m.content
            if isinstance(content, list):  # content parts: text only
                if any(part.get("type") != "text" for part in content):
                    raise Refused(400, "only text content parts are supported", "messages")
                content = "".join(part.get("text", "") for part in content)
            messages.append({"role": m.role, "content": content or ""})
        tokens = tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt=True),
                                  add_special_tokens=False)
        choices = []
        for choice in self.sample(request, tokens, _stops(request.stop), CHAT_MAX_TOKENS)[0]:
            logprobs = None
            if request.logprobs:
                logprobs = {"content": [{"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                                         "top_logprobs": []}
                                        for piece, lp in zip((tokenizer.decode([t]) for t in choice["tokens"]),
                                                             choice["logprobs"])]}
            choices.append({"index": len(choices), "message": {"role": "assistant", "content": choice["text"]},
                            "logprobs": logprobs, "finish_reason": choice["finish_reason"], "tokens": choice["tokens"]})
        completion_tokens = sum(len(c.pop("tokens")) for c in choices)
        body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": request.model, "choices": choices,
                "usage": {"prompt_tokens": len(tokens), "completion_tokens": completion_tokens,
                          "total_tokens": len(tokens) + completion_tokens}}
        if not request.stream:
            return body
        chunks = [{"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
                   "model": request.model,
                   "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": c["message"]["content"]},
                                "logprobs": c["logprobs"], "finish_reason": c["finish_reason"]}]}
                  for c in choices]
        return _stream(chunks)


def _stream(chunks: list[dict]) -> StreamingResponse:
    def events():
        for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _error(exc: Refused) -> JSONResponse:
    return JSONResponse({"error": {"message": exc.message, "type": "invalid_request_error" if exc.status < 500
                                   else "server_error", "param": exc.param, "code": exc.code}},
                        status_code=exc.status)


def app(serving: Serving, api_key: str) -> FastAPI:
    """The ASGI app of `txflow serve`."""
    endpoint = Endpoint(serving, api_key)
    api = FastAPI(title="txflow serve", docs_url=None, redoc_url=None, openapi_url=None)

    def route(handler, body_model: type[BaseModel] | None):
        def run(request: Request, body: bytes):
            try:
                endpoint.check_key(request)
                if body_model is None:
                    return handler()
                try:
                    parsed = body_model.model_validate_json(body or b"{}")
                except ValidationError as exc:
                    first = exc.errors()[0]
                    raise Refused(400, f"{'.'.join(map(str, first['loc'])) or 'body'}: {first['msg']}",
                                  ".".join(map(str, first["loc"])) or None) from None
                return handler(parsed)
            except Refused as exc:
                return _error(exc)

        return run

    handlers = {"/v1/models": (endpoint.models, None, "GET"),
                "/v1/completions": (endpoint.completions, CompletionRequest, "POST"),
                "/v1/chat/completions": (endpoint.chat, ChatRequest, "POST")}
    for path, (handler, model, method) in handlers.items():
        api.add_api_route(path, _receiving(route(handler, model)), methods=[method])
    return api


def _receiving(run):
    """The route's endpoint: reads the body, then answers in the thread pool (waiting on the cluster blocks no
    other request)."""
    from starlette.concurrency import run_in_threadpool

    async def receive(request: Request):
        return await run_in_threadpool(run, request, await request.body())

    return receive
