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
    # `token` but not `tokens`: max_tokens=5 (a sampling option) is no secret.
    r"(?P<key>\b[\w\-]*(?:secret|password|passwd|token(?!s)|api[_\-]?key|credential)[\w\-]*\b"
    r"[\"']?\s*[:=]\s*)(?P<value>\"[^\"]*\"|'[^']*'|[^\s,&\"'}]+)",
    re.IGNORECASE,
)
# Credentials in a URL's query string (signed and SAS URLs): Azure's `sig`, S3's `X-Amz-Signature`,
# `X-Amz-Credential` and `X-Amz-Security-Token`, GCS's `X-Goog-Signature` and `X-Goog-Credential`, and the
# usual `signature`, `key`, `apikey`, `token`, `access_token`, `password`, `secret`.
_QUERY_CREDENTIAL = re.compile(
    r"(?P<key>[?&;](?:sig|signature|x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|"
    r"x-goog-credential|key|apikey|api_key|token|access_token|password|secret)=)(?P<value>[^&#\s\"'<>]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?P<key>\b(?:Bearer|Basic)\s+)(?P<value>[A-Za-z0-9._~+/=\-]+)", re.IGNORECASE)


def redact(text: str, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """`text` with URL passwords, query-string credentials, secret-looking key=value pairs and each of
    `secrets` masked."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    text = _QUERY_CREDENTIAL.sub(lambda m: f"{m['key']}***", text)
    text = _BEARER.sub(lambda m: f"{m['key']}***", text)
    return _SECRET_PAIR.sub(lambda m: f"{m['key']}***", text)


_secrets: set[str] = set()


def register_secret(value: str | None) -> None:
    """Mask `value` in every later log line of this process, whoever logs it."""
    if value and len(value) >= 4:
        _secrets.add(value)
        _scrub_every_record()


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
    """Mask the run's storage options, its API key and every password or query-string credential inside a
    URL it was given (database, dataset, checkpoints, resume point) in every later log line and message of
    this process, Prefect's own records (task-failure tracebacks included) as much as txflow's."""
    from urllib.parse import urlsplit

    from sqlalchemy.engine import make_url

    for value in cfg.plain_storage_options().values():
        register_secret(value)
    if cfg.api_key is not None:
        register_secret(cfg.api_key.get_secret_value())
    if cfg.database_url is not None:
        register_secret(make_url(cfg.database_url.get_secret_value()).password)
    for url in (cfg.dataset, cfg.eval_dataset, cfg.checkpoints, cfg.resume_from):
        try:
            register_secret(urlsplit(url or "").password)
        except ValueError:
            pass  # not a URL: nothing inside it to hide
        for match in _QUERY_CREDENTIAL.finditer(url or ""):
            register_secret(match["value"])  # also where it shows without its name (a path, an error)
    _scrub_every_record()


def _scrub_every_record() -> None:
    """Every log record this process creates from now on carries its message and traceback scrubbed, whoever
    logs it (Prefect logs a failed task's traceback itself, to stderr and to its API)."""
    global _factory_installed
    if _factory_installed:
        return
    _factory_installed = True
    upstream = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = upstream(*args, **kwargs)
        record.msg, record.args = scrub(record.getMessage()), ()
        if record.exc_info:  # formatted now, scrubbed; no handler gets the raw traceback to render its own way
            record.exc_text = scrub(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return record

    logging.setLogRecordFactory(factory)


_factory_installed = False
