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
cluster.json. Can go when upstream checks keys.
"""

from __future__ import annotations

import hmac
import json

API_KEY_ENV = "TXFLOW_API_KEY"
OPEN_PATHS = frozenset({"/api/v1/healthz"})
REFUSED = json.dumps({"detail": "missing or wrong API key: send the run's key in the X-API-Key header "
                                "(TINKER_API_KEY for the Tinker SDK)"}).encode()


def presented_key(headers: dict[bytes, bytes]) -> bytes | None:
    """The key a request carries: `X-API-Key`, else an `Authorization: Bearer` token."""
    if b"x-api-key" in headers:
        return headers[b"x-api-key"]
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


class KeyCheck:
    """ASGI middleware: every HTTP request but the health check must present `key`."""

    def __init__(self, app, key: str):
        if not key:
            raise ValueError("the Tinker API needs a key to check (txflow gives it one per run)")
        self.app, self._key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = presented_key({k.lower(): v for k, v in scope.get("headers") or []})
        if given is not None and hmac.compare_digest(given, self._key):
            return await self.app(scope, receive, send)
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(REFUSED)).encode())]})
        await send({"type": "http.response.body", "body": REFUSED})


def install(app, key: str) -> None:
    """Check `key` in front of every route of `app` (added last, so it runs first)."""
    app.add_middleware(KeyCheck, key=key)
