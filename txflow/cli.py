"""`txflow run sft|rl|custom [options]`, `txflow export URL --to DIR` and `txflow discover URL`.

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
import re
import signal
import sys
import threading
import time
import traceback
import types
import typing
from contextlib import ExitStack
from pathlib import Path

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from txflow.config import (
    PROMOTION_NAME_PATTERN,
    SECRET_ENV,
    RunConfig,
    storage_options_from_env,
)
from txflow.log import register_secret, scrub
from txflow.processes import umask

# Flags whose name is not the field's name with '-' for '_'.
FLAG_NAMES = {
    "storage_options": "--storage-option",
    "client_args": "--client-arg",
    "startup_timeout_s": "--startup-timeout",
    "step_timeout_s": "--step-timeout",
}
# Fields given as the positional argument, not as a flag.
POSITIONAL = {"mode"}


def flag_of(name: str) -> str:
    return FLAG_NAMES.get(name) or "--" + name.replace("_", "-")


def _run_options(model: type[BaseModel], parser, prefix: str = "", only: tuple[str, ...] | None = None,
                 hidden: tuple[str, ...] = ()) -> None:
    """One flag per field of `model` (recursively for nested models), of the top-level fields `only` when
    given; dest is the dotted field path. The `hidden` ones are parsed (a command refuses them in a line that
    says what to use instead) but not listed in `--help`."""
    for name, info in model.model_fields.items():
        if name in POSITIONAL and not prefix or (only is not None and not prefix and name not in only):
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
        help_text = (info.description or "") + _default_of(info)
        hide = dest in hidden
        origin = typing.get_origin(annotation)
        if name in SECRET_ENV and not prefix:
            hint = ("A flag shows in `ps` to every local user: prefer the environment variable."
                    if SECRET_ENV[name] in help_text else
                    f"Prefer {SECRET_ENV[name]} in the environment: a flag shows in `ps` to every local user.")
            parser.add_argument(flag, dest=dest, metavar="KEY=VALUE" if origin is dict else name.upper(),
                                action="append" if origin is dict else "store",
                                help=_help(help_text + (" (repeatable)" if origin is dict else "") + " " + hint, hide))
        elif origin is list:
            parser.add_argument(flag, dest=dest, action="append", metavar="VALUE",
                                help=_help(help_text + " (repeatable)", hide))
        elif origin is dict:
            parser.add_argument(flag, dest=dest, action="append", metavar="KEY=VALUE",
                                help=_help(help_text + " (repeatable)", hide))
        elif inner is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, help=_help(help_text, hide))
        elif typing.get_origin(inner) is typing.Literal:  # the model checks the choice, in one line
            parser.add_argument(flag, dest=dest, metavar="{" + ",".join(typing.get_args(inner)) + "}",
                                help=_help(help_text, hide))
        else:
            parser.add_argument(flag, dest=dest, metavar=name.upper().removesuffix("_S"), help=_help(help_text, hide))


def _help(text: str, hide: bool) -> str:
    return argparse.SUPPRESS if hide else text


def _default_of(info) -> str:
    """` (default: X)` for a field whose default is a plain value; fields whose default depends on others say
    so in their description."""
    value = info.default
    if value is None or value is PydanticUndefined or isinstance(value, (BaseModel, list, dict)):
        return ""
    if isinstance(value, bool):
        return f" (default: {'on' if value else 'off'})"
    return f" (default: {value})"


def versions() -> str:
    """txflow's version and those of the upstream packages it adapts, for `--version` and bug reports."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    return f"txflow {of('txflow')} (skyrl-tx {of('skyrl-tx')}, tinker {of('tinker')}, prefect {of('prefect')})"


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line that names the culprit, not the usage of every option.
        self.exit(2, f"txflow: invalid options: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="txflow", description="LoRA fine-tuning on a self-hosted SkyRL-tx cluster")
    parser.add_argument("--version", action="version", version=versions())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run the train flow in-process on Prefect's embedded API",
                         argument_default=argparse.SUPPRESS)
    run.add_argument("mode", choices=list(typing.get_args(RunConfig.model_fields["mode"].annotation)))
    _run_options(RunConfig, run)
    run.add_argument("--config", dest="config_file", metavar="FILE", help=CONFIG_HELP)
    run.add_argument("--json", action="store_true", default=False, help="print the run report as JSON on stdout")
    export = sub.add_parser("export", help="export a run's trained adapter as Hugging Face PEFT (and merged), proven")
    export.add_argument("url", help="a run root, or the sampler checkpoint of one that evaluate-restore checked")
    export.add_argument("--to", required=True, metavar="DIR", help="destination, any fsspec URL: DIR/peft, DIR/merged")
    export.add_argument("--merged", action="store_true", help="also export the base model with the adapter merged in")
    export.add_argument("--force", action="store_true", help="replace what DIR holds")
    export.add_argument("--base-model", metavar="M", help="the base model's directory or hub id (default: the run's)")
    export.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    export.add_argument("--json", action="store_true", help="print the export's figures as JSON on stdout")
    discover = sub.add_parser("discover", help="list the artifacts under an fsspec URL")
    discover.add_argument("url")
    discover.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    discover.add_argument("--json", action="store_true")
    discover.add_argument("--no-require-commit", dest="require_commit", action="store_false",
                          help="do not treat checkpoints without a txflow commit marker as incomplete "
                               "(for directories SkyRL-tx wrote without txflow)")
    runs = sub.add_parser("runs", help="the runs under a checkpoints root, newest first: how each ended, its adapter")
    runs.add_argument("root", help="the checkpoints root (the --checkpoints of the runs), any fsspec URL")
    runs.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    runs.add_argument("--json", action="store_true")
    prune = sub.add_parser("prune", help="delete the periodic state checkpoints runs no longer need")
    prune.add_argument("root", help="the checkpoints root (the --checkpoints of the runs), any fsspec URL")
    prune.add_argument("--keep-last", type=int, metavar="K", help="keep each run's newest K periodic states")
    prune.add_argument("--older-than", type=float, metavar="DAYS", help="delete only states older than DAYS")
    prune.add_argument("--dry-run", action="store_true", help="say what would go, delete nothing")
    prune.add_argument("--include-failed", action="store_true",
                       help="prune failed and unfinished runs too (their newest state stays)")
    prune.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    prune.add_argument("--json", action="store_true")
    sweep = sub.add_parser("sweep", help="train a grid of learning rates and LoRA ranks side by side on one cluster",
                           argument_default=argparse.SUPPRESS, conflict_handler="resolve")
    sweep.add_argument("mode", choices=["sft", "rl"])
    # What a sweep sets itself (its members' ids, their promotion) or does not run (a custom client): refused in
    # one line by `sweep_cmd`, not listed.
    _run_options(RunConfig, sweep, hidden=("run_id", "promote_as", "approve", "approve_timeout_s", "client",
                                           "client_args", "client_python"))
    sweep.add_argument("--config", dest="config_file", metavar="FILE", help=CONFIG_HELP)
    # The grid: the two fields a sweep varies take comma-separated values here (the last flag of a name wins).
    sweep.add_argument("--learning-rate", dest="learning_rate", metavar="R1,R2,...",
                       help="learning rates to try, comma-separated")
    sweep.add_argument("--lora-rank", dest="lora_rank", metavar="K1,K2,...", help="LoRA ranks to try, comma-separated")
    sweep.add_argument("--sweep-id", dest="sweep_id", help="the sweep's id; members are <sweep-id>-NN")
    sweep.add_argument("--promote-best-as", dest="promote_best_as", metavar="NAME",
                       help="promote the exported adapter of the best member that passed under this name")
    sweep.add_argument("--json", action="store_true", default=False, help="print the ranking as JSON on stdout")
    cluster = sub.add_parser("cluster", help="a long-lived cluster that runs attach to (--cluster NAME)")
    actions = cluster.add_subparsers(dest="action", required=True, parser_class=_Parser)
    up = actions.add_parser("up", help="start the cluster and hold it until `txflow cluster down NAME` (or Ctrl-C)",
                            argument_default=argparse.SUPPRESS)
    up.add_argument("name")
    from txflow.cluster.named import CLUSTER_FIELDS

    _run_options(RunConfig, up, only=CLUSTER_FIELDS)
    up.add_argument("--config", dest="config_file", metavar="FILE", help=CONFIG_HELP)
    up.add_argument("--detach", action="store_true", default=False,
                    help="return once the cluster is up, holding it from a process of its own (its log: "
                         "<clusters dir>/NAME-holder.log); `txflow cluster down NAME` stops it")
    for action, text in (("status", "what the cluster serves, whether it is healthy, free adapter slots, attached "
                                    "runs"), ("down", "stop the cluster")):
        sub_action = actions.add_parser(action, help=text)
        sub_action.add_argument("name")
        sub_action.add_argument("--json", action="store_true", default=False)
    key = actions.add_parser("key", help="a key of its own for a notebook or any Tinker client: prints "
                             "TINKER_BASE_URL and TINKER_API_KEY to export; it reaches only what it creates")
    key.add_argument("name")
    key.add_argument("--label", default="notebook", help="what `txflow cluster keys` lists it as (default: notebook)")
    key.add_argument("--ttl", default="8h", help="how long it is valid: 30m, 8h, 2d or seconds (default: 8h)")
    keys = actions.add_parser("keys", help="the keys given out and the runs attached; --revoke LABEL revokes a key")
    keys.add_argument("name")
    keys.add_argument("--revoke", metavar="LABEL", help="revoke the key given out as LABEL (401 from its next call)")
    keys.add_argument("--json", action="store_true", default=False)
    serve = sub.add_parser("serve", help="OpenAI's text API (/v1/models, /v1/completions, /v1/chat/completions) over "
                           "the base model and trained adapters, on a warm cluster; prints OPENAI_BASE_URL and "
                           "OPENAI_API_KEY to export")
    serve.add_argument("--cluster", required=True, metavar="NAME", help="the warm cluster to sample on "
                       "(`txflow cluster up NAME`)")
    serve.add_argument("--adapter", action="append", default=[], metavar="NAME=URL",
                       help="serve a run's checked sampler as model NAME: URL is the run root (or that sampler "
                            "checkpoint); repeat for several; the base model is always served by its name")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="the port (default: 8000; 0: a free one)")
    serve.add_argument("--timeout-s", type=float, default=300.0,
                       help="deadline of a sample on the cluster, and of attaching to it (default: 300)")
    serve.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    promoted = sub.add_parser("promoted", help="what is promoted under a name, with its figures and history")
    promoted.add_argument("root", help="the checkpoints root the runs promoted into")
    promoted.add_argument("name")
    promoted.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    promoted.add_argument("--json", action="store_true")
    return parser


def prune_cmd(args) -> int:
    """`txflow prune ROOT`: 0 when done (or, dry, planned), 2 on bad input (nothing deleted)."""
    from txflow.artifacts import prune

    try:
        options = _command_storage_options(args.storage_option)
        runs, trimmed = prune.root(args.root, args.keep_last, args.older_than, options, dry_run=args.dry_run,
                                   include_failed=args.include_failed)
    except ValueError as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    freed = sum(run.bytes_freed for run in runs)
    if args.json:
        json.dump({"dry_run": args.dry_run, "bytes_freed": freed,
                   "runs": [{**run.model_dump(), "bytes_freed": run.bytes_freed} for run in runs],
                   "promotions_removed": trimmed}, sys.stdout, indent=2)
        print()
    verb = "would delete" if args.dry_run else "deleted"
    out = sys.stderr if args.json else sys.stdout  # with --json, stdout carries the JSON alone
    for run in runs:
        if run.skipped:
            print(f"{run.run_id}: skipped, {run.skipped}", file=out)
        for deletion in run.deletions:
            print(f"{run.run_id}: {verb} {deletion.url} ({deletion.bytes:,} bytes): {deletion.reason}", file=out)
    for url in trimmed:
        print(f"deleted {url}: an older promotion", file=out)
    count = sum(len(run.deletions) for run in runs)
    print(f"txflow: {verb} {count} checkpoints of {len(runs)} runs, {freed:,} bytes"
          + (" would be freed" if args.dry_run else " freed"), file=sys.stderr)
    return 0


def promoted_cmd(args) -> int:
    """`txflow promoted ROOT NAME`: the current promotion and its history; 1 when nothing is promoted."""
    from txflow.checkpoints import promotion

    try:
        if not re.fullmatch(PROMOTION_NAME_PATTERN, args.name):
            raise ValueError(f"{args.name!r} is no promotion name (1-64 letters, digits, '.', '-' or '_')")
        options = _command_storage_options(args.storage_option)
        current = promotion.current(args.root, args.name, options)
        kept = promotion.history(args.root, args.name, options)
    except ValueError as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    if args.json:
        json.dump({"current": current, "history": kept}, sys.stdout, indent=2)
        print()
    if current is None:
        print(f"txflow: nothing is promoted as {args.name!r} under {args.root}", file=sys.stderr)
        return 1
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(current["promoted_at"]))
    lines = [f"{args.name}: run {current['run_id']} ({current['mode']}, base model {current['base_model']}), "
             f"promoted {when}", f"  adapter: {current['files']['peft']}"]
    if "merged" in current["files"]:
        lines.append(f"  merged model: {current['files']['merged']}")
    lines += [f"  {k}: {v:.6g}" if isinstance(v, float) else f"  {k}: {v}" for k, v in current["figures"].items()]
    if current.get("approver"):
        lines.append(f"  approved by: {current['approver']}")
    if current.get("approval_comment"):
        lines.append(f"  approved: {current['approval_comment']}")
    lines.append("  history: " + ", ".join(f"{r['id']} (run {r['run_id']})" for r in kept if r["id"] != current["id"])
                 if len(kept) > 1 else "  history: none before it")
    print("\n".join(lines), file=sys.stderr if args.json else sys.stdout)
    return 0


def _storage_options(pairs: list[str]) -> dict[str, str]:
    """`--storage-option KEY=VALUE` flags as a dict; every value is masked in all later output."""
    from txflow.log import register_secret

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            # Not echoed: it may well be the secret itself.
            raise ValueError("every --storage-option must be KEY=VALUE (one was not; its text is not shown)")
        register_secret(value)
        options[key] = value
    return options


def _command_storage_options(pairs: list[str]) -> dict[str, str]:
    """The storage options of prune, discover, export and promoted: TXFLOW_STORAGE_OPTIONS, then the flags
    (which win); every value masked in all later output."""
    from txflow.log import register_secret

    options = {k: v.get_secret_value() for k, v in storage_options_from_env().items()}
    for value in options.values():
        register_secret(value)
    return options | _storage_options(pairs)


NESTED_MODELS = {name for name, info in RunConfig.model_fields.items()
                 if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)}
CONFIG_HELP = ("a YAML, TOML or JSON file of these options (field names, nested as `mesh: {tp: 2}`); a flag given "
               "as well wins")


def load_config_file(path: str | None) -> dict:
    """The RunConfig fields in a YAML, TOML or JSON file (by its extension), `-` in a name read as `_`;
    ValueError in one line naming the file when it cannot be read."""
    if not path:
        return {}
    import tomllib

    import yaml

    file = Path(path)
    readers = {".yaml": yaml.safe_load, ".yml": yaml.safe_load, ".toml": tomllib.loads, ".json": json.loads}
    if file.suffix.lower() not in readers:
        raise ValueError(f"--config {path}: name a .yaml, .toml or .json file")
    try:
        data = readers[file.suffix.lower()](file.read_text())
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc.strerror})") from None
    except Exception as exc:  # each format's own parse error: its first line says where
        raise ValueError(f"--config {path}: not valid {file.suffix[1:]} ({str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: holds a {type(data).__name__}, not a table of options")

    def names(table: dict) -> dict:
        return {str(k).replace("-", "_"): v for k, v in table.items()}

    # Option names as flags spell them are read as fields; the keys of a dict option (storage_options) stay.
    return {k: names(v) if k in NESTED_MODELS and isinstance(v, dict) else v for k, v in names(data).items()}


def _merged(base: dict, over: dict) -> dict:
    """`over` on top of `base`, nested tables merged."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def config_values(args: argparse.Namespace) -> dict:
    """The RunConfig fields of `--config FILE`, with the ones given on the command line over them, nested where
    the model nests them."""
    from_file = load_config_file(getattr(args, "config_file", None))
    mode = getattr(args, "mode", None)
    if mode is not None and from_file.get("mode", mode) != mode:
        raise ValueError(f"--config {args.config_file} says mode {from_file['mode']}, the command says {mode}")
    values: dict = {}
    for dest, value in vars(args).items():
        if dest in ("command", "json", "action", "name", "config_file", "argv", "detach"):
            continue
        if dest == "storage_options":
            value = _storage_options(value)
        target = values
        *parents, leaf = dest.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return _merged(from_file, values)


def _fields_line(exc: ValidationError) -> str:
    """A config's validation errors in one line: `field: message; ...`."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())


def _on_sigterm(signum, frame):
    # Turn SIGTERM into the same path as Ctrl-C, so the flow's teardown runs.
    raise KeyboardInterrupt(f"signal {signum}")


def run(args) -> int:
    os.umask(umask.PRIVATE)  # before anything is created: the run's files, logs and processes are private
    try:
        config = RunConfig.model_validate(config_values(args)).resolved()
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            exc = _fields_line(exc)
        print(f"txflow: invalid options: {scrub(str(exc))}", file=sys.stderr)
        return 2
    from txflow.log import register_run_secrets
    from txflow.preflight import PreflightError, prepare_ahead

    register_run_secrets(config)  # before anything can print a URL or a backend's error
    try:
        prepare_ahead(config)  # bad input: one line and exit 2, before anything starts
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
    signal.signal(signal.SIGTERM, _on_sigterm)
    from txflow.reporting.bar import PROGRESS_ENV

    if sys.stderr.isatty():
        os.environ.setdefault(PROGRESS_ENV, "1")

    from txflow.cluster import embedded_prefect

    with held, embedded_prefect.server(config.state_dir) as prefect_server:
        from flows.train import RunFailed, train_flow  # imports while the server starts

        if prefect_server is not None:
            prefect_server.wait_ready()
        try:
            report = train_flow(config=config)
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


def sweep_cmd(args) -> int:
    """`txflow sweep sft|rl --learning-rate A,B --lora-rank K,L ...`: 0 when every member passed, 1 when one
    failed, 2 on bad input (any member's, before anything starts)."""
    os.umask(umask.PRIVATE)
    extra = {k: getattr(args, k) for k in ("sweep_id", "promote_best_as") if hasattr(args, k)}
    for k in extra:
        delattr(args, k)
    grid = {}
    try:
        for name, kind in (("learning_rate", float), ("lora_rank", int)):
            if hasattr(args, name):
                text = getattr(args, name)
                delattr(args, name)
                try:
                    grid[name] = [kind(v) for v in text.split(",") if v.strip()]
                except ValueError:
                    raise ValueError(f"--{name.replace('_', '-')} {text!r}: comma-separated numbers") from None
        if "promote_best_as" in extra and not re.fullmatch(PROMOTION_NAME_PATTERN, extra["promote_best_as"]):
            raise ValueError(f"--promote-best-as {extra['promote_best_as']!r} is no promotion name")
        if "sweep_id" in extra and not re.fullmatch(r"[A-Za-z0-9_-]{1,60}", extra["sweep_id"]):
            raise ValueError(f"--sweep-id {extra['sweep_id']!r} must be 1-60 letters, digits, '-' or '_'")
        refused = {"run_id": "a sweep names its runs <sweep-id>-NN: use --sweep-id",
                   "promote_as": "a sweep promotes its best run: use --promote-best-as",
                   "approve": "a sweep's runs do not wait for approval"}
        for field, why in refused.items():
            if hasattr(args, field):
                raise ValueError(f"--{field.replace('_', '-')}: {why}")
        config = RunConfig.model_validate(config_values(args))
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            exc = _fields_line(exc)
        print(f"txflow: invalid options: {scrub(str(exc))}", file=sys.stderr)
        return 2
    from flows.sweep import members_of, new_sweep_id, state_of
    from txflow.log import register_run_secrets

    register_run_secrets(config)
    sweep_id = extra.get("sweep_id") or new_sweep_id(config.mode)
    config = config.model_copy(update={"state_dir": str(state_of(config, sweep_id))})
    try:
        members_of(config, grid.get("learning_rate", []), grid.get("lora_rank", []), sweep_id)
    except ValueError as exc:  # PreflightError included: one member's bad input refuses the sweep
        if isinstance(exc, ValidationError):
            exc = "invalid options: " + _fields_line(exc)
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    from txflow.cluster import embedded_prefect

    print(f"txflow: sweep {sweep_id}, state directory {config.state_dir}", file=sys.stderr)
    with embedded_prefect.server(config.state_dir) as prefect_server:
        from flows.sweep import SweepFailed, sweep_flow

        if prefect_server is not None:
            prefect_server.wait_ready()
        try:
            result = sweep_flow(config=config, learning_rates=grid.get("learning_rate"),
                                lora_ranks=grid.get("lora_rank"), sweep_id=sweep_id,
                                promote_best_as=extra.get("promote_best_as"))
        except SweepFailed as failed:
            result = failed.result
    if args.json:
        print(json.dumps(result, indent=2))
    for row in result["members"]:
        figure = f", {result['ranked_by']} {row['figure']:.4g}" if row["figure"] is not None else ""
        why = f" ({row['error'].splitlines()[0]})" if row["error"] else ""
        print(f"txflow: #{row['rank'] or '-'} {row['run_id']} lr {row['learning_rate']:g} rank {row['lora_rank']}: "
              f"{row['status']}{why}{figure}", file=sys.stderr)
    promoted = result.get("promoted")
    print(f"txflow: sweep {sweep_id}: best {result['best'] or 'none (no member passed)'}"
          + (f", promoted as {promoted['name']}" if promoted else "") + f"; ranking at {result['ranking_file']}",
          file=sys.stderr)
    return 0 if not result["failed"] else 1


def duration_s(text: str) -> float:
    """`30m`, `8h`, `2d`, `90s` or plain seconds, in seconds; ValueError in one line otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match:
        raise ValueError(f"--ttl {text!r}: give a duration such as 30m, 8h, 2d or a number of seconds")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


def cluster_keys_cmd(args) -> int:
    """`txflow cluster key NAME` gives out a key; `txflow cluster keys NAME [--revoke LABEL]` lists or revokes."""
    from datetime import datetime

    from txflow.cluster import named

    if args.action == "key":
        ttl_s = duration_s(args.ttl)
        key, serves = named.issue_key(args.name, args.label, ttl_s)
        expires = datetime.fromtimestamp(time.time() + ttl_s).isoformat(timespec="minutes")
        print(f"export TINKER_BASE_URL={serves.base_url}\nexport TINKER_API_KEY={key}")
        print(f"txflow: key {args.label!r} on cluster {args.name} until {expires}: it reaches only what it creates; "
              f"base_model {serves.base_model}; revoke it with `txflow cluster keys {args.name} --revoke "
              f"{args.label}`", file=sys.stderr)
        return 0
    if args.revoke:
        if not named.revoke_key(args.name, args.revoke):
            print(f"txflow: cluster {args.name} has no key labelled {args.revoke}", file=sys.stderr)
            return 2
        print(f"txflow: key {args.revoke!r} revoked on cluster {args.name}", file=sys.stderr)
        return 0
    rows = named.list_keys(args.name)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        when = (f"expires {datetime.fromtimestamp(row['expires']).isoformat(timespec='minutes')}"
                + (" (expired)" if row["expired"] else "") if row["expires"] else "until the run releases it")
        print(f"{row['kind']:4} {row['label']:24} {when}")
    return 0


def cluster_cmd(args) -> int:
    """`txflow cluster up|status|down|key|keys NAME`: 0 when done (status: when healthy), 1 when not, 2 on bad
    input."""
    from txflow.cluster import named

    os.umask(umask.PRIVATE)
    try:
        if args.action in ("key", "keys"):
            return cluster_keys_cmd(args)
        if args.action == "status":
            found = named.status(args.name)
            if args.json:
                print(json.dumps(found, indent=2))
            else:
                print(f"cluster {args.name}: {'healthy' if found['healthy'] else 'NOT healthy'} ({found['state']}), "
                      f"{found['base_model']} on {found['base_url']}, LoRA rank <= {found['max_lora_rank']}, "
                      f"{found['free_slots']} of {found['lora_adapters'] - 1} adapter slots free, attached: "
                      f"{', '.join(found['attached_runs']) or 'none'}")
            return 0 if found["healthy"] else 1
        if args.action == "down":
            records = named.down(args.name)
            print(f"txflow: cluster {args.name} down: "
                  + (", ".join(f"{r.role} pid {r.pid} exit {r.exit_text}" for r in records) or "nothing ran"),
                  file=sys.stderr)
            return 0
        values = {k: v for k, v in config_values(args).items() if k not in ("name", "action")}
        config = RunConfig.model_validate(values)
    except (named.AttachFailed, ValueError) as exc:
        if isinstance(exc, ValidationError):
            exc = _fields_line(exc)
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    from txflow.config import RUN_ID_PATTERN

    if not re.fullmatch(RUN_ID_PATTERN, args.name):
        print(f"txflow: cluster name {args.name!r} must be 1-64 letters, digits, '-' or '_'", file=sys.stderr)
        return 2
    if getattr(args, "detach", False):
        return _detached_up(args, config)
    from txflow.cluster.launcher import PlacementFailed

    try:
        handle = named.up(config, args.name)
    except (named.AttachFailed, PlacementFailed) as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    print(f"txflow: cluster {args.name} up on {handle.cluster.base_url}; attach runs with --cluster {args.name}",
          file=sys.stderr, flush=True)
    records = named.hold(handle, args.name)
    print(f"txflow: cluster {args.name} stopped: " + ", ".join(f"{r.role} pid {r.pid} exit {r.exit_text}"
                                                              for r in records), file=sys.stderr)
    return 0 if not handle.monitor.failures else 1


def _detached_up(args, config: RunConfig) -> int:
    """`cluster up --detach`: the same `cluster up` without it, in a session of its own (no terminal's Ctrl-C or
    hang-up reaches it), waited for until the cluster is up: 0 then; its exit code and the end of its log if it
    ends first."""
    import subprocess

    from txflow.cluster import named

    log_path = named.clusters_dir() / f"{args.name}-holder.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [a for a in args.argv if a != "--detach"]
    with open(log_path, "w") as log:
        holder = subprocess.Popen([sys.executable, "-c", "from txflow.cli import entry; entry()", *argv],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + config.startup_timeout_s + 60
    while time.monotonic() < deadline:
        code = holder.poll()
        serves = named.load_serves(args.name)
        if code is None and serves is not None and serves.holder_pid == holder.pid and serves.state == "up":
            print(f"txflow: cluster {args.name} up on {serves.base_url} (held by pid {holder.pid}, log {log_path}); "
                  f"attach runs with --cluster {args.name}, stop it with `txflow cluster down {args.name}`",
                  file=sys.stderr)
            return 0
        if code is not None:
            print(scrub(log_path.read_text()[-2000:]), end="", file=sys.stderr)
            return code or 1
        time.sleep(0.2)
    holder.terminate()  # its own shutdown stops whatever it started
    print(f"txflow: cluster {args.name} not up within {config.startup_timeout_s + 60:.0f} s; stopped it (log "
          f"{log_path})", file=sys.stderr)
    return 1


def runs_cmd(args) -> int:
    """`txflow runs ROOT`: 0 with one line per run, 2 on bad input (no run there)."""
    from txflow.reporting.runs import list_runs, table

    try:
        rows = list_runs(args.root, _command_storage_options(args.storage_option))
    except (FileNotFoundError, ValueError) as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


def discover_cmd(args) -> int:
    """`txflow discover URL`: 0 when every artifact is complete, 1 when one is not, 2 on bad input (nothing
    there, a URL or storage option that does not serve), as every command."""
    from txflow.artifacts import discover

    try:
        artifacts = discover.url(args.url, _command_storage_options(args.storage_option),
                                 require_commit=args.require_commit)
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    if args.json:
        json.dump([a.model_dump() for a in artifacts], sys.stdout, indent=2)
        print()
    else:
        for a in artifacts:
            state = "complete" if a.complete else f"INCOMPLETE: {a.reason}"
            files = a.files if a.files is not None else "-"
            print(f"{a.kind:8} {a.format:9} {a.bytes:>12} B {files:>5} files  {a.url}  [{state}]")
    return 0 if all(a.complete for a in artifacts) else 1


def export_cmd(args) -> int:
    """`txflow export URL --to DIR`: 0 when the export is written and proven, 1 when its proof fails (nothing
    is written), 2 on bad input (nothing is started)."""
    from txflow.artifacts import export
    from txflow.checkpoints.export import ExportError, failure

    try:
        result = export.url(args.url, args.to, _command_storage_options(args.storage_option), args.base_model,
                            merged=args.merged, force=args.force,
                            log=lambda line: print(f"txflow: {line}", file=sys.stderr))
    except (ExportError, ValueError) as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(result.model_dump(), sys.stdout, indent=2)
        print()
    problem = failure(result)
    if problem:
        print(f"txflow: export check failed: {problem}; nothing was written to {args.to}", file=sys.stderr)
        return 1
    print(f"txflow: exported {result.peft_url}" + (f" and {result.merged_url}" if result.merged_url else "")
          + f", proven: max |Δ logprob| {result.max_abs_logprob_diff:.2e}, greedy tokens match", file=sys.stderr)
    return 0


def serve_cmd(args) -> int:
    """`txflow serve --cluster NAME [--adapter NAME=URL ...]`: serves until SIGINT or SIGTERM, then unloads what
    it loaded and gives its key back (0); 2 on bad input, before anything is loaded."""
    import secrets
    import socket
    import tempfile

    import uvicorn

    from txflow.serving import models, openai_api

    try:
        options = _command_storage_options(args.storage_option)
        references = models.references(models.parse_adapters(args.adapter), options)
        sock = socket.create_server((args.host, args.port))
    except (ValueError, OSError) as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    # A key of its own for the endpoint's clients (TXFLOW_SERVE_API_KEY to choose it), never the cluster's.
    api_key = os.environ.get("TXFLOW_SERVE_API_KEY") or "sk-txflow-" + secrets.token_hex(16)
    register_secret(api_key)
    with tempfile.TemporaryDirectory(prefix="txflow-serve-") as state, sock:
        try:
            serving = models.attach(args.cluster, options, Path(state), args.timeout_s)
        except Exception as exc:  # noqa: BLE001 (no such cluster, not up, no slot: one line)
            print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
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
            "serve": serve_cmd}[args.command](args)


def entry() -> None:
    """The `txflow` command: `main`, then an exit without the interpreter's teardown of every module
    (torch's, Prefect's: ~2 s after the run is over, measured). When `main` returns, everything of the
    run is done and written: the flow's teardown, Prefect's log and event workers drained, the server
    stopped. An exception still takes the ordinary way out, with its traceback."""
    try:
        code = main()
    except Exception:  # what nothing caught still reaches the terminal, with every known secret masked
        from txflow.log import scrub

        sys.stderr.write(scrub(traceback.format_exc()))
        code = 1
    for thread in threading.enumerate():  # none today; a non-daemon thread would still get to finish
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join(timeout=10)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
