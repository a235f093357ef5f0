"""`txflow run sft|rl|custom [options]` and `txflow discover URL`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from pydantic import ValidationError

from txflow.config import RunConfig
from txflow.progress import PROGRESS_ENV

# CLI flag -> RunConfig field; the defaults and help texts come from the model.
RUN_OPTIONS = {
    "--steps": "steps",
    "--processes": "processes",
    "--base-model": "base_model",
    "--checkpoints": "checkpoints",
    "--dataset": "dataset",
    "--lora-rank": "lora_rank",
    "--learning-rate": "learning_rate",
    "--batch-size": "batch_size",
    "--save-every": "save_every",
    "--seed": "seed",
    "--run-id": "run_id",
    "--state-dir": "state_dir",
    "--database-url": "database_url",
    "--host": "host",
    "--startup-timeout": "startup_timeout_s",
    "--step-timeout": "step_timeout_s",
    "--train-retries": "train_retries",
    "--group-size": "group_size",
    "--loss": "loss",
    "--reward": "reward",
    "--max-tokens": "max_tokens",
    "--temperature": "temperature",
    "--client": "client",
    "--client-python": "client_python",
    "--resume-from": "resume_from",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="txflow", description="LoRA fine-tuning on a self-hosted SkyRL-tx cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the train flow in-process on Prefect's embedded API")
    run.add_argument("mode", choices=["sft", "rl", "custom"])
    for flag, field in RUN_OPTIONS.items():
        info = RunConfig.model_fields[field]
        run.add_argument(flag, dest=field, default=None, help=info.description)
    run.add_argument("--client-arg", dest="client_args", action="append", default=[], metavar="ARG",
                     help=RunConfig.model_fields["client_args"].description + " (repeatable)")
    run.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                     help="fsspec storage option for the checkpoint root (repeatable; never logged)")
    run.add_argument("--json", action="store_true", help="print the run report as JSON on stdout")
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


def _on_sigterm(signum, frame):
    # Turn SIGTERM into the same path as Ctrl-C, so the flow's teardown runs.
    raise KeyboardInterrupt(f"signal {signum}")


def run(args) -> int:
    values = {field: getattr(args, field) for field in RUN_OPTIONS.values() if getattr(args, field) is not None}
    values["mode"] = args.mode
    values["client_args"] = args.client_args
    if os.environ.get("TINKER_API_KEY"):
        # The standard Tinker variable, so the key stays off the command line.
        values["api_key"] = os.environ["TINKER_API_KEY"]
    try:
        values["storage_options"] = _storage_options(args.storage_option)
    except ValueError as exc:
        print(f"txflow: {exc}", file=sys.stderr)
        return 2
    try:
        config = RunConfig.model_validate(values).resolved()
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        print(f"txflow: invalid options: {errors}", file=sys.stderr)
        return 2
    print(f"txflow: run {config.run_id}, state directory {config.state_dir}", file=sys.stderr)
    signal.signal(signal.SIGTERM, _on_sigterm)
    if sys.stderr.isatty():
        os.environ.setdefault(PROGRESS_ENV, "1")

    from flows.train import RunFailed, train_flow
    from txflow.preflight import PreflightError

    try:
        report = train_flow(config=config)
        code = 0
    except RunFailed as failed:
        report, code = failed.report, 1
    except (PreflightError, ValueError) as exc:
        print(f"txflow: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(f"txflow: run {report['run_id']} {report['status']}; report at {report['checkpoint_root']}/report.json",
              file=sys.stderr)
    return code


def discover_cmd(args) -> int:
    from txflow.discovery import discover

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
            print(f"{a.kind:8} {a.format:9} {a.bytes:>12} B {a.files:>5} files  {a.url}  [{state}]")
    return 0 if all(a.complete for a in artifacts) else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Logs go to stderr; stdout carries only the --json report.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    # Prefect's embedded server otherwise sends telemetry heartbeats (no network here, and
    # they contend for its SQLite file under load: "database is locked").
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The embedded server creates and migrates a fresh SQLite database on first use; on a busy
    # 2-core machine that took more than Prefect's default 20 s, and the run failed before it began.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    return run(args) if args.command == "run" else discover_cmd(args)


if __name__ == "__main__":
    sys.exit(main())
