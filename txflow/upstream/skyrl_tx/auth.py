"""Point 15: only the run's own clients get in.

SkyRL-tx 0.3.0's API checks no key: anyone who reaches its port can create sessions, sample, save
weights under names of their choosing, load states and unload the run's model (on one machine every
local user; with `--host` on a routable address, anyone on that network). `install` puts a check in
front of every route but the health check, which the cluster's own start-up polls before any client
exists and which tells nothing: a request must carry the run's key in `X-API-Key` (how every Tinker SDK
from 0.13 to 0.38 sends it, the `client/config` handshake of 0.25 and 0.38 included) or as
`Authorization: Bearer` (for other tools), compared in constant time; anything else gets 401 with one
line. The handshake declares JWT auth off (`tinker_compat`, shim 1), so the SDKs send the key itself.
The key reaches the API through its environment (`API_KEY_ENV`), never a command line, a log or
cluster.json. The one other exception is a signed checkpoint download (point 20, `DownloadSigner`): what
`get_checkpoint_archive_url` hands out, as Tinker's signed URLs, for tools that send no key (`tinker
checkpoint download`, the cookbook's urllib); it opens that one checkpoint's download until it expires,
and a tampered or expired one gets 403. Can go when upstream checks keys and signs its download URLs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from urllib.parse import parse_qs

API_KEY_ENV = "TXFLOW_API_KEY"
OPEN_PATHS = frozenset({"/api/v1/healthz"})
REFUSED = json.dumps({"detail": "missing or wrong API key: send the run's key in the X-API-Key header "
                                "(TINKER_API_KEY for the Tinker SDK)"}).encode()


EXPIRED = json.dumps({"detail": "this checkpoint download URL is expired or was altered: ask for a new one "
                                "(get_checkpoint_archive_url)"}).encode()
# The only paths a signature opens: one checkpoint's archive bytes, one file of an external-weights export
# (point 20).
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


class KeyCheck:
    """ASGI middleware: every HTTP request but the health check must present `key`, or be a download that
    carries a signature (judged by `signer` alone: valid passes, anything else gets 403)."""

    def __init__(self, app, key: str, signer: DownloadSigner | None = None):
        if not key:
            raise ValueError("the Tinker API needs a key to check (txflow gives it one per run)")
        self.app, self._key, self._signer = app, key.encode(), signer

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
            return await self.app(scope, receive, send)
        await _refuse(send, 401, REFUSED)


async def _refuse(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def install(app, key: str, signer: DownloadSigner | None = None) -> None:
    """Check `key` in front of every route of `app` (added last, so it runs first); `signer` opens signed
    checkpoint downloads."""
    app.add_middleware(KeyCheck, key=key, signer=signer)
