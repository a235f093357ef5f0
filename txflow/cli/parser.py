"""The argument parser: `txflow run`'s options generated from `RunConfig` (every field a flag, nested models
flattened as `--mesh-fsdp`, the field's description its help, its default shown), and each command's own flags."""

from __future__ import annotations

import argparse
import types
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from txflow.cli.options import CONFIG_HELP
from txflow.config import (
    FLAT_NAMES,
    GROUPED,
    SECRET_ENV,
    RunConfig,
)

# RunConfig's option groups in `--help`; their flags keep the flat names they had before the grouping.
GROUP_TITLES = {"rl": "RL options", "ray": "Ray options", "custom": "custom client options",
                "export": "export and promotion options"}

# Flags whose name is not the field's name with '-' for '_'.
FLAG_NAMES = {
    "storage_options": "--storage-option",
    "eval_task": "--eval",
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
    given; dest is the dotted field path, but for RunConfig's option groups (rl, ray, custom, export): their
    fields keep their flat names (FLAT_NAMES, `--group-size`), listed in `--help` under their group. The
    `hidden` ones are parsed (a command refuses them in a line that says what to use instead) but not listed in
    `--help`."""
    for name, info in model.model_fields.items():
        if name in POSITIONAL and not prefix or (only is not None and not prefix and name not in only):
            continue
        dest = prefix + name
        inner = _inner(info.annotation)
        if not prefix and name in GROUPED:
            flats = [(flat, field) for flat, (group, field) in FLAT_NAMES.items() if group == name]
            # A group whose every flag this command hides has no heading in its help either.
            shown = any(flat not in hidden for flat, _ in flats)
            section = parser.add_argument_group(GROUP_TITLES[name], inner.__doc__) if shown else parser
            for flat, field in flats:
                _add_option(section, flat, field, inner.model_fields[field], flat in hidden)
        elif isinstance(inner, type) and issubclass(inner, BaseModel):
            _run_options(inner, parser, prefix=dest + ".")
        else:
            _add_option(parser, dest, name if not prefix else dest, info, dest in hidden)


def _inner(annotation):
    """`X` of `X | None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _add_option(parser, dest: str, name: str, info, hide: bool) -> None:
    """The flag of one field: `dest` where its value lands, `name` the field's (its metavar)."""
    annotation = info.annotation
    inner = _inner(annotation)
    flag = flag_of(dest.replace(".", "_"))
    help_text = (info.description or "") + _default_of(info)
    origin = typing.get_origin(annotation)
    if dest in SECRET_ENV:
        hint = ("A flag shows in `ps` to every local user: prefer the environment variable."
                if SECRET_ENV[dest] in help_text else
                f"Prefer {SECRET_ENV[dest]} in the environment: a flag shows in `ps` to every local user.")
        parser.add_argument(flag, dest=dest, metavar="KEY=VALUE" if origin is dict else dest.upper(),
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
        parser.add_argument(flag, dest=dest, metavar=name.rsplit(".", 1)[-1].upper().removesuffix("_S"),
                            help=_help(help_text, hide))


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


def _cluster_and_adapters(parser, verb: str, base: str) -> None:
    """What `serve` and `eval` share: the warm cluster, the adapters by name, the deadline, storage options."""
    parser.add_argument("--cluster", required=True, metavar="NAME", help="the warm cluster to sample on "
                        "(`txflow cluster up NAME`)")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=URL",
                        help=f"{verb} a run's checked sampler as model NAME: URL is the run root (or that sampler "
                             f"checkpoint); repeat for several; the base model is always {base}")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="deadline of a sample on the cluster, and of attaching to it (default: 300)")
    parser.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")


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
                                           "client_args", "client_python", "tracking_parent"))
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
    _cluster_and_adapters(serve, "serve", "served by its name")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="the port (default: 8000; 0: a free one)")
    evaluate = sub.add_parser("eval", help="score the base model and trained adapters on a task with Inspect, "
                              "through txflow's OpenAI-compatible endpoint on a warm cluster")
    _cluster_and_adapters(evaluate, "score", "scored")
    evaluate.add_argument("--task", default="arithmetic", metavar="TASK",
                          help="`arithmetic` (the bundled held-out set) or a JSONL file of {\"prompt\", \"answer\"} "
                               "rows, any fsspec URL (default: arithmetic)")
    evaluate.add_argument("--limit", type=int, metavar="N", help="the first N samples only (default: all)")
    evaluate.add_argument("--max-tokens", type=int, default=16, metavar="N",
                          help="tokens each answer may take (default: 16)")
    evaluate.add_argument("--log-dir", metavar="DIR", help="where Inspect's logs and eval.json go "
                          "(default: .txflow/evals/<time>)")
    evaluate.add_argument("--tracking-uri", metavar="URI", help="the MLflow store the scores go to, beside each "
                          "adapter's training run (default: as `txflow run`'s; `off`: none)")
    evaluate.add_argument("--json", action="store_true", help="print the scores as JSON on stdout")
    promoted = sub.add_parser("promoted", help="what is promoted under a name, with its figures and history")
    promoted.add_argument("root", help="the checkpoints root the runs promoted into")
    promoted.add_argument("name")
    promoted.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE")
    promoted.add_argument("--json", action="store_true")
    return parser
