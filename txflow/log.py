"""Logging that never carries a credential, and the redaction it applies.

Tasks log through `get_logger()`: the Prefect run logger inside a run (so lines
reach the Prefect UI), the `txflow` logger outside one. Every message passes
through `redact` with the run's secrets first.
"""

from __future__ import annotations

import logging
import re

# Credentials in URLs (scheme://user:password@host) and in key=value / JSON pairs.
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@\s]+)@")
_SECRET_PAIR = re.compile(
    r"(?P<key>\b[\w\-]*(?:secret|password|passwd|token|api[_\-]?key|credential)[\w\-]*\b"
    r"[\"']?\s*[:=]\s*)(?P<value>\"[^\"]*\"|'[^']*'|[^\s,\"'}]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?P<key>\b(?:Bearer|Basic)\s+)(?P<value>[A-Za-z0-9._~+/=\-]+)", re.IGNORECASE)


def redact(text: str, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """`text` with URL passwords, secret-looking key=value pairs and each of `secrets` masked."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    text = _BEARER.sub(lambda m: f"{m['key']}***", text)
    return _SECRET_PAIR.sub(lambda m: f"{m['key']}***", text)


_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    """Mask `value` in every later log line of this process."""
    if value and len(value) >= 4:
        _secrets.add(value)


def scrub(text: str) -> str:
    """`text` with every registered secret and credential-looking value masked."""
    return redact(text, sorted(_secrets, key=len, reverse=True))


class _Redacting(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return scrub(str(msg)), kwargs


def get_logger() -> logging.LoggerAdapter:
    try:
        from prefect.exceptions import MissingContextError
        from prefect.logging import get_run_logger

        base = get_run_logger()
    except (ImportError, MissingContextError, RuntimeError):
        base = logging.getLogger("txflow")
    return _Redacting(base, {})


def register_run_secrets(cfg) -> None:
    """Mask the run's storage options and database password in every later log line."""
    from sqlalchemy.engine import make_url

    for value in cfg.plain_storage_options().values():
        register_secret(value)
    if cfg.api_key is not None:
        register_secret(cfg.api_key.get_secret_value())
    if cfg.database_url is not None:
        register_secret(make_url(cfg.database_url.get_secret_value()).password)
