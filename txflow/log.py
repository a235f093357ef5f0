"""Logging that never carries a credential.

Tasks log through `get_logger()`: the Prefect run logger inside a run (so lines
reach the Prefect UI), the `txflow` logger outside one. Every message passes
through `redact` with the run's secrets first.
"""

from __future__ import annotations

import logging

from txflow.skyrl_adapter import redact

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
