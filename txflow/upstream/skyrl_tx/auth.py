"""The `api-key-check` change: only the run's own clients get in.

SkyRL-tx 0.3.0's API checks no key: anyone who reaches its port can create sessions, sample, save
weights under names of their choosing, load states and unload the run's model (on one machine every
local user; with `--host` on a routable address, anyone on that network). `install` puts a check in
front of every route but the health check, which the cluster's own start-up polls before any client
exists and which tells nothing: a request must carry the run's key in `X-API-Key` (how every Tinker SDK
from 0.13 to 0.38 sends it, the `client/config` handshake of 0.25 and 0.38 included) or as
`Authorization: Bearer` (for other tools), compared in constant time; anything else gets 401 with one
line. The handshake declares JWT auth off (`tinker_compat`, shim 1), so the SDKs send the key itself.
The key reaches the API through its environment (`API_KEY_ENV`), never a command line, a log or
cluster.json. The one other exception is a signed checkpoint download (the `rest-surface` change, `DownloadSigner`):
what `get_checkpoint_archive_url` hands out, as Tinker's signed URLs, for tools that send no key (`tinker checkpoint
download`, the cookbook's urllib); it opens that one checkpoint's download until it expires, and a tampered or expired
one gets 403. Can go when upstream checks keys and signs its download URLs.

A shared cluster (`txflow cluster up`) also lets in the keys of the runs attached to it, each
valid only for what that run created: the file named by `RUN_KEYS_ENV` maps the SHA-256 of each key to its
run (written by `txflow.cluster.named` when a run attaches, and emptied of it when the run releases; read
again whenever it changes). A session belongs to the key that created it, a model or sampling session to
its session, a future to the key whose request created it, a checkpoint to its model; a run's key gets 403
on anything else, on the listings (they span runs) and on any route this check does not know. Owners are
keys, not run ids (two processes given one run id own nothing of each other's), and what a key that left
the file created is forgotten. The check reads a body and a checkpoint path exactly as the route will
(`read_body`, `tinker_model_id`): what it cannot read so is refused, never let through as naming nothing.
The cluster's own key (`API_KEY_ENV`) stays unscoped; it may ask what a run's key holds (`OWNED_PATH?owner=`
its digest), which the cluster's holder releases when that run died without its teardown. Upstream has no
owners at all: can go when it scopes keys."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
from pathlib import Path
from urllib.parse import parse_qs

API_KEY_ENV = "TXFLOW_API_KEY"
RUN_KEYS_ENV = "TXFLOW_RUN_KEYS_FILE"
OPEN_PATHS = frozenset({"/api/v1/healthz"})
LIMITS_ENV = "TXFLOW_API_LIMITS"


class Limits:
    """What one request, and one run's key, may ask of the API (`RunConfig.api_max_*`, given to the API as
    `LIMITS_ENV`): each refused in one line naming the limit and its flag, before the request is read into
    anything bigger than its bytes."""

    FLAGS = {"body_mb": "--api-max-body-mb", "samples": "--api-max-samples", "tokens": "--api-max-tokens",
             "batch": "--api-max-batch", "sessions": "--api-max-sessions-per-key",
             "models": "--api-max-models-per-key"}

    def __init__(self, body_mb: float = 64.0, samples: int = 1024, tokens: int = 4096, batch: int = 4096,
                 sessions: int = 64, models: int = 64):
        self.body_mb, self.samples, self.tokens, self.batch = body_mb, samples, tokens, batch
        self.sessions, self.models = sessions, models

    @classmethod
    def from_env(cls) -> Limits:
        return cls(**json.loads(os.environ.get(LIMITS_ENV) or "{}"))

    def refusal(self, what: str, value, limit: str) -> tuple[int, bytes]:
        return 400, json.dumps({"detail": f"{what} {value} is above this cluster's limit {getattr(self, limit)} "
                                          f"({self.FLAGS[limit]})"}).encode()

    def of_body(self, path: str, body) -> tuple[int, bytes] | None:
        """The refusal of a request body that asks for more than one request may, else None."""
        if not isinstance(body, dict):
            return None
        samples = body.get("num_samples")
        if isinstance(samples, int) and samples > self.samples:
            return self.refusal("num_samples", samples, "samples")
        params = body.get("sampling_params")
        tokens = params.get("max_tokens") if isinstance(params, dict) else None
        if isinstance(tokens, int) and tokens > self.tokens:
            return self.refusal("max_tokens", tokens, "tokens")
        for field in ("forward_backward_input", "forward_input"):
            data = body.get(field, {}).get("data") if isinstance(body.get(field), dict) else None
            if isinstance(data, list) and len(data) > self.batch:
                return self.refusal(f"a {path.rsplit('/', 1)[-1]} of", f"{len(data)} items", "batch")
        return None
REFUSED = json.dumps({"detail": "missing or wrong API key: send the run's key in the X-API-Key header "
                                "(TINKER_API_KEY for the Tinker SDK)"}).encode()


EXPIRED = json.dumps({"detail": "this checkpoint download URL is expired or was altered: ask for a new one "
                                "(get_checkpoint_archive_url)"}).encode()
# The only paths a signature opens: one checkpoint's archive bytes, one file of an external-weights export
# (`rest-surface`).
DOWNLOAD_PATH = re.compile(r"/api/v1/training_runs/[A-Za-z0-9_:-]+/checkpoints/((weights|sampler_weights)/"
                           r"[A-Za-z0-9_-]+/download|external_weights/[A-Za-z0-9_-]+/files/[A-Za-z0-9_.-]+)")


class DownloadSigner:
    """Signs and checks checkpoint download URLs: an HMAC-SHA256 over the download path and its expiry, with a
    secret of this API process alone (drawn at start, never written anywhere), so a URL opens that one
    checkpoint's download for `ttl_s` seconds and nothing else."""

    def __init__(self, ttl_s: float = 15 * 60, clock=time.time):
        self._secret, self.ttl_s, self._clock = secrets.token_bytes(32), ttl_s, clock

    def _signature(self, path: str, expires: int) -> str:
        return hmac.new(self._secret, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()

    def sign(self, path: str) -> tuple[str, int]:
        """The query (`expires=...&signature=...`) that opens `path` until the returned expiry (Unix time)."""
        expires = int(self._clock() + self.ttl_s)
        return f"expires={expires}&signature={self._signature(path, expires)}", expires

    def opens(self, path: str, query: str) -> bool:
        """Whether `query` is a valid, unexpired signature of `path`, a download path."""
        fields = parse_qs(query)
        expires, signature = fields.get("expires", [""])[0], fields.get("signature", [""])[0]
        if not DOWNLOAD_PATH.fullmatch(path) or not expires.isdigit() or not signature:
            return False
        return hmac.compare_digest(signature, self._signature(path, int(expires))) and int(expires) >= self._clock()


def presented_key(headers: dict[bytes, bytes]) -> bytes | None:
    """The key a request carries: `X-API-Key`, else an `Authorization: Bearer` token."""
    if b"x-api-key" in headers:
        return headers[b"x-api-key"]
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


def key_digest(key: str | bytes) -> str:
    """What the run-keys file records of a key: its SHA-256, never the key."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


class RunKeys:
    """The run-keys file (`{sha256 of key: {"owner": ..., "expires": unix time or null, ...}}`), read again
    whenever its modification time or size changes; a missing or unreadable file lets no run key in, and a key
    past its `expires` is refused as if revoked."""

    def __init__(self, path: str | Path, clock=time.time):
        self.path, self._seen, self._owners, self._clock = Path(path), None, {}, clock

    def owner(self, key: bytes) -> str | None:
        """The key's owner: its digest (one attach of one run; a second attach of the same run id is another
        owner), or None when no attached run holds it."""
        digest = key_digest(key)
        return digest if digest in self.current() else None

    def current(self) -> set[str]:
        """The digests the file holds now (read again when it changed) that have not expired."""
        try:
            st = os.stat(self.path)
            seen = (st.st_mtime_ns, st.st_size, st.st_ino)
            if seen != self._seen:
                self._owners, self._seen = json.loads(self.path.read_text() or "{}"), seen
        except (OSError, ValueError):
            self._owners, self._seen = {}, None
        now = self._clock()
        return {digest for digest, record in self._owners.items()
                if not (isinstance(record, dict) and isinstance(record.get("expires"), int | float)
                        and now >= record["expires"])}


# txflow's own route, answered by the key check: the sessions and models the presented run key owns.
OWNED_PATH = "/api/v1/txflow/owned"
# What a run's key may call without naming anything it owns: nothing there touches another run's work.
UNSCOPED = frozenset({"/api/v1/create_session", "/api/v1/get_server_capabilities", "/api/v1/telemetry",
                      "/api/v1/client/config"})
# Routes that name what they act on in their path: (pattern, kind of the id).
PATH_IDS = [(re.compile(r"/api/v1/(?:training_runs|models)/([^/]+)(?:/.*)?"), "model"),
            (re.compile(r"/api/v1/sessions/([^/]+)(?:/finish)?"), "session"),
            (re.compile(r"/api/v1/samplers/([^/]+)"), "sampler")]
LISTINGS = frozenset({"/api/v1/training_runs", "/api/v1/sessions", "/api/v1/checkpoints"})
BODY_IDS = {"session_id": "session", "model_id": "model", "sampling_session_id": "sampler",
            "request_id": "future"}


PROTOBUF = b"application/x-protobuf"


def read_body(path: str, headers: list[tuple[bytes, bytes]], raw: bytes):
    """A request's body as its route reads it, or ValueError when it cannot be read so. One Content-Type
    header at most; its media type (case and parameters aside) decides, as the routes decide: protobuf on
    forward_backward (txflow's route, `tinker_compat`), JSON where FastAPI parses JSON (no Content-Type, or
    `application/json` or `application/*+json`, whatever its parameters), and txflow's forward_backward
    parses anything else as JSON too. Any other body is refused rather than passed unread."""
    types = [value for key, value in headers if key.lower() == b"content-type"]
    if len(types) > 1:
        raise ValueError("send one Content-Type header")
    if not raw:
        return None
    media = types[0].split(b";")[0].strip().lower() if types else b""
    if media == PROTOBUF:
        if path != "/api/v1/forward_backward":
            raise ValueError(f"{path} takes no protobuf body")
        from txflow.upstream.skyrl_tx.protobuf import parse_forward_backward

        try:
            return parse_forward_backward(raw)[0]
        except Exception as exc:
            raise ValueError(f"unreadable protobuf forward_backward body ({type(exc).__name__})") from None
    kind, _, subtype = media.partition(b"/")
    if media and path != "/api/v1/forward_backward" and not (kind == b"application" and (
            subtype == b"json" or subtype.endswith(b"+json"))):
        raise ValueError(f"{path} takes a JSON body (Content-Type application/json), not {media.decode('latin-1')}")
    try:
        return json.loads(raw)
    except ValueError:
        raise ValueError("unreadable JSON body") from None


def tinker_model_id(value: str) -> str | None:
    """The model a string names when the routes read it as a checkpoint path (upstream's `TinkerPath.parse`,
    urllib's parser: any scheme case, leading blanks, tabs and newlines anywhere), else None."""
    from urllib.parse import urlparse

    try:
        parsed = urlparse(value)
    except ValueError:
        return None
    return parsed.netloc if parsed.scheme == "tinker" else None


def _forbidden(what: str) -> bytes:
    return json.dumps({"detail": f"this run's API key does not own {what}: a key of a shared cluster serves "
                                 f"only its own run's sessions, models, checkpoints and futures"}).encode()


def named_ids(path: str, body: dict | None) -> list[tuple[str, str]] | None:
    """(kind, id) of everything a request names, from its path and JSON body; None for a route a run's key
    may not call at all (a listing, or a route this check does not know)."""

    if path in LISTINGS:
        return None
    ids = []
    for pattern, kind in PATH_IDS:
        match = pattern.fullmatch(path)
        if match:
            ids.append((kind, match.group(1)))
            break
    else:
        if path not in UNSCOPED and not (path.startswith("/api/v1/") and body is not None):
            return None

    def walk(value, key=None):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, k)
        elif isinstance(value, list):
            for v in value:
                walk(v, key)
        elif isinstance(value, str | int) and key in BODY_IDS and value != "":
            ids.append((BODY_IDS[key], str(value)))
        elif isinstance(value, str) and (model := tinker_model_id(value)) is not None:
            ids.append(("model", model))  # read as the route reads it, whatever its spelling

    walk(body or {})
    return ids


class Owners:
    """Who owns what on a shared cluster, in the API process: sessions and futures as they are created (a
    response naming them), models and sampling sessions through their session in the engine's database."""

    def __init__(self):
        self.sessions: dict[str, str] = {}
        self.futures: dict[str, str] = {}
        self.models: dict[str, str] = {}  # created through a key, counted against its limit

    async def owner(self, app, kind: str, ident: str) -> str | None:
        if kind == "session":
            return self.sessions.get(ident)
        if kind == "future":
            return self.futures.get(ident)
        from sqlalchemy import text

        table, column = ("models", "model_id") if kind == "model" else ("sampling_sessions", "sampling_session_id")
        async with app.state.db_engine.connect() as conn:
            row = (await conn.execute(text(f"SELECT session_id FROM {table} WHERE {column} = :id"),
                                      {"id": ident})).first()
        if row is None and kind == "model" and ":train:" in ident:
            return self.sessions.get(ident.split(":train:")[0])  # 0.38 names models after their session
        return self.sessions.get(row[0]) if row is not None else None

    def beyond(self, owner: str, path: str, limits: Limits) -> tuple[int, bytes] | None:
        """The refusal (429) of a request that would create one session or model more than a key may hold."""
        for route, held, limit in (("/api/v1/create_session", self.sessions, "sessions"),
                                   ("/api/v1/create_model", self.models, "models")):
            count = sum(1 for o in held.values() if o == owner)
            if path == route and count >= getattr(limits, limit):
                return 429, limits.refusal(f"{limit} created with this key:", count + 1, limit)[1]
        return None

    def note(self, owner: str, answer: dict, path: str = "") -> None:
        """Record what a response to `owner`'s request created."""
        if "session_id" in answer and isinstance(answer["session_id"], str):
            self.sessions.setdefault(answer["session_id"], owner)
        if path == "/api/v1/create_model" and isinstance(answer.get("model_id"), str):
            self.models.setdefault(answer["model_id"], owner)
        for key in ("request_id", "future_id"):
            if isinstance(answer.get(key), str | int):
                self.futures.setdefault(str(answer[key]), owner)

    async def owned(self, app, owner: str) -> dict[str, list[str]]:
        """The sessions `owner` created and the models in them (those it created, however it created them)."""
        from sqlalchemy import bindparam, text

        sessions = sorted(s for s, o in self.sessions.items() if o == owner)
        models = {m for m, o in self.models.items() if o == owner}
        if sessions:
            query = text("SELECT model_id FROM models WHERE session_id IN :ids").bindparams(
                bindparam("ids", expanding=True))
            async with app.state.db_engine.connect() as conn:
                models |= {row[0] for row in (await conn.execute(query, {"ids": sessions})).all()}
        return {"sessions": sessions, "models": sorted(models)}

    def forget_all_but(self, owners: set[str]) -> None:
        """Forget what keys no longer in the run-keys file (released, revoked) created."""
        self.sessions = {k: v for k, v in self.sessions.items() if v in owners}
        self.futures = {k: v for k, v in self.futures.items() if v in owners}
        self.models = {k: v for k, v in self.models.items() if v in owners}


class KeyCheck:
    """ASGI middleware: every HTTP request but the health check must present `key`, or be a download that
    carries a signature (judged by `signer` alone: valid passes, anything else gets 403), or present a run's
    key from `run_keys` and name only what that run owns."""

    def __init__(self, app, key: str, signer: DownloadSigner | None = None, run_keys: RunKeys | None = None,
                 limits: Limits | None = None):
        if not key:
            raise ValueError("the Tinker API needs a key to check (txflow gives it one per run)")
        self.app, self._key, self._signer, self._run_keys = app, key.encode(), signer, run_keys
        self.limits = limits or Limits()
        self.owners = Owners()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        query = scope.get("query_string", b"").decode("latin-1")
        if self._signer and DOWNLOAD_PATH.fullmatch(scope["path"]) and "signature=" in query:
            if self._signer.opens(scope["path"], query):
                return await self.app(scope, receive, send)
            return await _refuse(send, 403, EXPIRED)
        given = presented_key({k.lower(): v for k, v in scope.get("headers") or []})
        if given is not None and hmac.compare_digest(given, self._key):
            owner = None  # the cluster's own key: unscoped, bounded per request alone
        elif given is not None and self._run_keys is not None and (owner := self._run_keys.owner(given)):
            self.owners.forget_all_but(self._run_keys.current())
        else:
            return await _refuse(send, 401, REFUSED)
        if scope["path"] == OWNED_PATH:  # what a run's own key holds: what its teardown frees and commits
            if owner is None:  # the cluster's own key: what the run key of `owner` (its digest) holds
                # (the holder releases a run that died without its teardown: `txflow.cluster.named.reap`)
                owner = parse_qs(query).get("owner", [None])[0]
                if owner is None:
                    return await _refuse(send, 400, json.dumps({"detail": "the cluster's own key is not scoped: "
                                                                          "name a run key's ?owner="}).encode())
            return await _answer(send, 200, await self.owners.owned(scope.get("app") or self.app, owner))
        raw = await self._body(receive)
        if raw is None:
            return await _refuse(send, 413, json.dumps({"detail": f"the request body is above this cluster's limit "
                                                                  f"of {self.limits.body_mb:g} MB (--api-max-body-mb)"
                                                        }).encode())
        if owner is None:
            try:
                refusal = self.limits.of_body(scope["path"], read_body(scope["path"], scope.get("headers") or [],
                                                                       raw))
            except ValueError:  # the cluster's own client: upstream answers what it cannot read, as before
                refusal = None
            if refusal is not None:
                return await _refuse(send, *refusal)
            return await self.app(scope, _replaying(raw, receive), send)
        return await self._scoped(owner, scope, raw, receive, send)

    async def _body(self, receive) -> bytes | None:
        """The request's body, or None once it passes the body limit (the rest is not read)."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limits.body_mb * 2**20:
                return None
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def _scoped(self, owner: str, scope, raw: bytes, receive, send):
        """A run's key: the request goes through only when everything it names is the run's, within what one
        key may hold."""
        try:
            body = read_body(scope["path"], scope.get("headers") or [], raw)
            if body is None and scope["method"] == "POST":
                body = {}
            ids = named_ids(scope["path"], body if isinstance(body, dict) else None)
        except ValueError as exc:  # what the check cannot read as the route would, it does not let through
            return await _refuse(send, 400, json.dumps({"detail": str(exc)}).encode())
        refusal = self.limits.of_body(scope["path"], body) or self.owners.beyond(owner, scope["path"], self.limits)
        if refusal is not None:
            return await _refuse(send, *refusal)
        if ids is None:
            return await _refuse(send, 403, _forbidden(f"{scope['path']} (it spans runs or is not scoped)"))
        app = scope.get("app") or self.app
        for kind, ident in ids:
            if await self.owners.owner(app, kind, ident) != owner:
                return await _refuse(send, 403, _forbidden(f"{kind} {ident}"))
        answer: list[bytes] = []
        is_json = False

        async def noting(message):
            nonlocal is_json
            if message["type"] == "http.response.start":
                is_json = any(k.lower() == b"content-type" and b"json" in v for k, v in message.get("headers", []))
            elif message["type"] == "http.response.body" and is_json:
                answer.append(message.get("body", b""))
                if not message.get("more_body", False):
                    try:
                        parsed = json.loads(b"".join(answer))
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict):
                        self.owners.note(owner, parsed, scope["path"])
            await send(message)

        await self.app(scope, _replaying(raw, receive), noting)


def _replaying(raw: bytes, receive):
    """An ASGI `receive` that gives the body read already, then whatever comes after (a disconnect)."""
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replay


async def _answer(send, status: int, answer: dict) -> None:
    await _refuse(send, status, json.dumps(answer).encode())


async def _refuse(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def install(app, key: str, signer: DownloadSigner | None = None, run_keys_file: str | None = None,
            limits: Limits | None = None) -> None:
    """Check `key` in front of every route of `app` (added last, so it runs first); `signer` opens signed
    checkpoint downloads; `run_keys_file` names the keys of the runs attached to a shared cluster; `limits`
    bound each request and each run's key."""
    app.add_middleware(KeyCheck, key=key, signer=signer, run_keys=RunKeys(run_keys_file) if run_keys_file else None,
                       limits=limits)
