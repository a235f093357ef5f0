"""`txflow run sft|rl|custom`: the checks before anything starts (the flow's own pre-flight), the embedded Prefect
server started here so that it dies with this process, the flow, and the last line naming the exported adapter."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import ExitStack

from pydantic import ValidationError

from txflow.cli.options import config_values, fields_line
from txflow.config import RunConfig
from txflow.log import scrub
from txflow.processes import umask


class Interrupted(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt (so the flow's teardown runs the same way); the
    command exits 128 + its number, as a shell reports a process the signal ended."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def on_sigterm(signum, frame):
    raise Interrupted(signum)


def run(args) -> int:
    os.umask(umask.PRIVATE)  # before anything is created: the run's files, logs and processes are private
    try:
        config = RunConfig.model_validate(config_values(args)).resolved()
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            exc = fields_line(exc)
        print(f"txflow: invalid options: {scrub(str(exc))}", file=sys.stderr)
        return 2
    from txflow.log import register_run_secrets
    from txflow.preflight import PreflightError, prepare

    register_run_secrets(config)  # before anything can print a URL or a backend's error
    try:
        checked = prepare(config)  # bad input: one line and exit 2, before anything starts
    except PreflightError as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    from txflow.checkpoints import lease

    held = ExitStack()
    try:
        # Taken here (the flow joins it): of two runs past pre-flight at the same moment, the second is refused
        # as pre-flight refuses one, before anything starts.
        held.enter_context(lease.held(config.run_root, config.run_id, config.plain_storage_options()))
    except lease.LeaseHeld as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    print(f"txflow: run {config.run_id}, state directory {config.state_dir}", file=sys.stderr)
    signal.signal(signal.SIGTERM, on_sigterm)
    from txflow.reporting.bar import PROGRESS_ENV

    if sys.stderr.isatty():
        os.environ.setdefault(PROGRESS_ENV, "1")

    from txflow.cluster import embedded_prefect

    with held, embedded_prefect.server(config.state_dir) as prefect_server:
        from flows.train import RunFailed, checked_train_flow  # imports while the server starts

        if prefect_server is not None:
            prefect_server.wait_ready()
        try:
            report = checked_train_flow(checked)(config=config)
            code = 0
        except RunFailed as failed:
            report, code = failed.report, 1
    if args.json:
        print(report.to_json())
    else:
        from txflow.reporting.report import answers_text

        shown = answers_text(report)
        if shown:
            print("txflow: held-out prompts, before and after training:", *shown, sep="\n", file=sys.stderr)
        print(last_line(report), file=sys.stderr)
    return code


def last_line(report) -> str:
    """A run's last line: how it ended and, first, where the trained adapter is (and its promoted name)."""
    why = f" ({report.error.splitlines()[0]})" if report.error else ""
    adapter = report.export.peft_url if report.export is not None and report.export.passed else None
    where = f"; adapter at {adapter}" if adapter else ""
    if report.promotion is not None and report.promotion.status == "promoted":
        where += f" (promoted as {report.promotion.name})"
    return f"txflow: run {report.run_id} {report.status}{why}{where}; report at {report.checkpoint_root}/report.json"
