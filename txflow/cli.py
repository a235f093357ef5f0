"""`txflow run sft|rl|custom [options]` and `txflow discover URL`.

The options of `txflow run` are generated from `RunConfig`: every field has a
flag (nested models flattened, `--mesh-fsdp`), with the field's description as
its help, so the CLI, the deployments and the UI form cannot drift apart.

`txflow run` checks everything before it starts anything (the same pre-flight
the flow runs), then starts the embedded Prefect server itself, so that the
server dies with this process (`txflow.processes.lifeline`), while the flow's modules
import.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import types
import typing

from pydantic import BaseModel, SecretStr, ValidationError

from txflow.config import RunConfig

# Flags whose name is not the field's name with '-' for '_'.
FLAG_NAMES = {
    "storage_options": "--storage-option",
    "client_args": "--client-arg",
    "startup_timeout_s": "--startup-timeout",
    "step_timeout_s": "--step-timeout",
}
# Fields given as the positional argument, not as a flag.
POSITIONAL = {"mode"}
API_KEY_ENV = "TINKER_API_KEY"


def flag_of(name: str) -> str:
    return FLAG_NAMES.get(name) or "--" + name.replace("_", "-")


def _run_options(model: type[BaseModel], parser, prefix: str = "") -> None:
    """One flag per field of `model` (recursively for nested models); dest is the dotted field path."""
    for name, info in model.model_fields.items():
        if name in POSITIONAL and not prefix:
            continue
        dest = prefix + name
        annotation = info.annotation
        inner = annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # X | None -> X
            inner = next(a for a in typing.get_args(annotation) if a is not type(None))
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            _run_options(inner, parser, prefix=dest + ".")
            continue
        flag = flag_of(dest.replace(".", "_"))
        help_text = info.description or ""
        origin = typing.get_origin(annotation)
        if origin is list:
            parser.add_argument(flag, dest=dest, action="append", metavar="VALUE", help=help_text + " (repeatable)")
        elif origin is dict:
            parser.add_argument(flag, dest=dest, action="append", metavar="KEY=VALUE",
                                help=help_text + " (repeatable)")
        elif typing.get_origin(inner) is typing.Literal:  # the model checks the choice, in one line
            parser.add_argument(flag, dest=dest, metavar="{" + ",".join(typing.get_args(inner)) + "}",
                                help=help_text)
        elif inner is SecretStr and name == "api_key":
            parser.add_argument(flag, dest=dest, metavar="KEY",
                                help=help_text + f" Prefer {API_KEY_ENV} in the environment: a flag shows in `ps`.")
        else:
            parser.add_argument(flag, dest=dest, metavar=name.upper().removesuffix("_S"), help=help_text)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line that names the culprit, not the usage of every option.
        self.exit(2, f"txflow: invalid options: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="txflow", description="LoRA fine-tuning on a self-hosted SkyRL-tx cluster")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run the train flow in-process on Prefect's embedded API",
                         argument_default=argparse.SUPPRESS)
    run.add_argument("mode", choices=list(typing.get_args(RunConfig.model_fields["mode"].annotation)))
    _run_options(RunConfig, run)
    run.add_argument("--json", action="store_true", default=False, help="print the run report as JSON on stdout")
    discover = sub.add_parser("discover", help="list the artifacts under an fsspec URL")
    discover.add_argument("url")
    discover.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    discover.add_argument("--json", action="store_true")
    discover.add_argument("--no-require-commit", dest="require_commit", action="store_false",
                          help="do not treat checkpoints without a txflow commit marker as incomplete "
                               "(for directories SkyRL-tx wrote without txflow)")
    return parser


def _storage_options(pairs: list[str]) -> dict[str, str]:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option {pair!r} must be KEY=VALUE")
        options[key] = value
    return options


def config_values(args: argparse.Namespace) -> dict:
    """The RunConfig fields given on the command line, nested where the model nests them."""
    values: dict = {}
    for dest, value in vars(args).items():
        if dest in ("command", "json"):
            continue
        if dest == "storage_options":
            value = _storage_options(value)
        target = values
        *parents, leaf = dest.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    if "api_key" not in values and os.environ.get(API_KEY_ENV):
        # The standard Tinker variable, so the key stays off the command line.
        values["api_key"] = os.environ[API_KEY_ENV]
    return values


def _on_sigterm(signum, frame):
    # Turn SIGTERM into the same path as Ctrl-C, so the flow's teardown runs.
    raise KeyboardInterrupt(f"signal {signum}")


def run(args) -> int:
    try:
        config = RunConfig.model_validate(config_values(args)).resolved()
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            exc = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        print(f"txflow: invalid options: {exc}", file=sys.stderr)
        return 2
    from txflow.preflight import PreflightError, prepare

    try:
        prepare(config)  # bad input: one line and exit 2, before anything starts
    except PreflightError as exc:
        print(f"txflow: {exc}", file=sys.stderr)
        return 2
    print(f"txflow: run {config.run_id}, state directory {config.state_dir}", file=sys.stderr)
    signal.signal(signal.SIGTERM, _on_sigterm)
    from txflow.reporting.progress import PROGRESS_ENV

    if sys.stderr.isatty():
        os.environ.setdefault(PROGRESS_ENV, "1")

    from txflow.cluster import embedded_prefect

    with embedded_prefect.server(config.state_dir) as prefect_server:
        from flows.train import RunFailed, train_flow  # imports while the server starts

        if prefect_server is not None:
            prefect_server.wait_ready()
        try:
            report = train_flow(config=config)
            code = 0
        except RunFailed as failed:
            report, code = failed.report, 1
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(f"txflow: run {report['run_id']} {report['status']}; report at {report['checkpoint_root']}/report.json",
              file=sys.stderr)
    return code


def discover_cmd(args) -> int:
    from txflow.checkpoints.discovery import discover

    try:
        artifacts = discover(args.url, _storage_options(args.storage_option), require_commit=args.require_commit)
    except (FileNotFoundError, ValueError) as exc:
        print(f"txflow: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump([a.model_dump() for a in artifacts], sys.stdout, indent=2)
        print()
    else:
        for a in artifacts:
            state = "complete" if a.complete else f"INCOMPLETE: {a.reason}"
            files = a.files if a.files is not None else "-"
            print(f"{a.kind:8} {a.format:9} {a.bytes:>12} B {files:>5} files  {a.url}  [{state}]")
    return 0 if all(a.complete for a in artifacts) else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Logs go to stderr; stdout carries only the --json report.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect and Tinker request otherwise
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    # Prefect's embedded server otherwise sends telemetry heartbeats (no network here, and
    # they contend for its SQLite file under load: "database is locked").
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return run(args) if args.command == "run" else discover_cmd(args)


def entry() -> None:
    """The `txflow` command: `main`, then an exit without the interpreter's teardown of every module
    (torch's, Prefect's: ~2 s after the run is over, measured). When `main` returns, everything of the
    run is done and written: the flow's teardown, Prefect's log and event workers drained, the server
    stopped. An exception still takes the ordinary way out, with its traceback."""
    code = main()
    for thread in threading.enumerate():  # none today; a non-daemon thread would still get to finish
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(timeout=10)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
