"""The `txflow` command, a module per command: `run` (sft, rl, custom; the options generated from `RunConfig` in
`parser`, merged with a config file and the environment in `options`), `sweep`, `cluster`, `serve`, `eval`, and a run's
artifacts (`runs`, `discover`, `export`, `prune`, `promoted`, in `artifacts`).

`txflow run` checks everything before it starts anything (the same pre-flight the flow runs), then starts the
embedded Prefect server itself, so that the server dies with this process (`txflow.processes.lifeline`), while
the flow's modules import.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback

from txflow.cli.artifacts import discover_cmd, export_cmd, promoted_cmd, prune_cmd, runs_cmd
from txflow.cli.cluster import cluster_cmd, duration_s
from txflow.cli.evaluate import eval_cmd
from txflow.cli.options import config_values, load_config_file
from txflow.cli.parser import _default_of, _parser, flag_of, versions
from txflow.cli.run import last_line, run
from txflow.cli.serve import serve_cmd
from txflow.cli.sweep import sweep_cmd

# What tests and scripts reach through `txflow.cli`.
__all__ = ["_default_of", "_parser", "config_values", "duration_s", "entry", "flag_of", "last_line", "load_config_file",
           "main", "versions"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a detached `cluster up` runs again
    # Logs go to stderr; stdout carries only the --json report.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    # One line per Prefect, Tinker and S3 request (and "Found credentials ...") otherwise.
    for noisy in ("httpx", "botocore", "aiobotocore", "s3fs"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    # Prefect's embedded server otherwise sends telemetry heartbeats (no network here, and
    # they contend for its SQLite file under load: "database is locked").
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return {"run": run, "export": export_cmd, "discover": discover_cmd, "prune": prune_cmd,
            "promoted": promoted_cmd, "cluster": cluster_cmd, "sweep": sweep_cmd, "runs": runs_cmd,
            "serve": serve_cmd, "eval": eval_cmd}[args.command](args)


def entry() -> None:
    """The `txflow` command: `main`, then an exit without the interpreter's teardown of every module
    (torch's, Prefect's: ~2 s after the run is over, measured). When `main` returns, everything of the
    run is done and written: the flow's teardown, Prefect's log and event workers drained, the server
    stopped. An interrupt (Ctrl-C, SIGTERM) leaves the same way once the flow's teardown has run: the
    interpreter's own exit would wait without bound for every non-daemon thread (a worker still blocked
    on a request to the cluster it just released), and a cancelled run must end."""
    # `kill -USR1 <pid>`: every thread's stack on stderr (the run's log), for a command that seems stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        code = main()
    except BrokenPipeError:  # `txflow discover URL | head`: the reader had what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    except KeyboardInterrupt as exc:  # the teardown ran on the way here (the flow's `finally`, its hooks)
        signum = getattr(exc, "signum", signal.SIGINT)
        sys.stderr.write(f"txflow: interrupted ({signal.Signals(signum).name})\n")
        code = 128 + signum
    except Exception:  # what nothing caught still reaches the terminal, with every known secret masked
        from txflow.log import scrub

        sys.stderr.write(scrub(traceback.format_exc()))
        code = 1
    deadline = time.monotonic() + 10  # a non-daemon thread gets to finish, within bounds
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
