"""`txflow serve`: OpenAI's text API over the base model and trained adapters, on a warm cluster."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from txflow.cli.options import command_storage_options
from txflow.log import register_secret, scrub


def serve_cmd(args) -> int:
    """`txflow serve --cluster NAME [--adapter NAME=URL ...]`: serves until SIGINT or SIGTERM, then unloads what
    it loaded and gives its key back (0); 2 on bad input, before anything is loaded."""
    import secrets
    import socket
    import tempfile

    import uvicorn

    from txflow.serving import models, openai_api

    try:
        options = command_storage_options(args.storage_option)
        references = models.references(models.parse_adapters(args.adapter), options)
        sock = socket.create_server((args.host, args.port))
    except (ValueError, OSError) as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    # A key of its own for the endpoint's clients (TXFLOW_SERVE_API_KEY to choose it), never the cluster's.
    api_key = os.environ.get("TXFLOW_SERVE_API_KEY") or "sk-txflow-" + secrets.token_hex(16)
    register_secret(api_key)
    with tempfile.TemporaryDirectory(prefix="txflow-serve-") as state, sock:
        serving = attached(args, options, Path(state))
        if serving is None:
            return 2
        try:
            models.load(serving, references)
            host, port = sock.getsockname()[:2]
            print(f"export OPENAI_BASE_URL=http://{host}:{port}/v1\nexport OPENAI_API_KEY={api_key}", flush=True)
            print(f"txflow: serving {', '.join(serving.models)} from cluster {args.cluster} on http://{host}:{port}/v1 "
                  f"until Ctrl-C", file=sys.stderr, flush=True)
            # uvicorn ends `run` at SIGINT or SIGTERM, then raises that signal again with the handler it found:
            # one that does nothing, so that the release below runs and the command exits 0.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: None)
            uvicorn.Server(uvicorn.Config(openai_api.app(serving, api_key), log_level="warning")).run(sockets=[sock])
        finally:
            models.release(serving)
    return 0


def attached(args, options: dict[str, str], state: Path):
    """`--cluster` attached with a key of this process's own (`serve`, `eval`); None, said in one line, when it
    cannot be (no such cluster, not up, no slot)."""
    from txflow.serving import models

    try:
        return models.attach(args.cluster, options, state, args.timeout_s)
    except Exception as exc:  # noqa: BLE001
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return None
