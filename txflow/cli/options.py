"""What `txflow run` and `txflow sweep` are given, merged: a config file (`--config`), the environment, the flags, in
that order of precedence; storage options from flags and the environment."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pydantic import BaseModel, ValidationError

from txflow.config import (
    RunConfig,
    nest_flat_names,
    storage_options_from_env,
)
from txflow.log import register_secret


def _storage_options(pairs: list[str]) -> dict[str, str]:
    """`--storage-option KEY=VALUE` flags as a dict; every value is masked in all later output."""

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            # Not echoed: it may well be the secret itself.
            raise ValueError("every --storage-option must be KEY=VALUE (one was not; its text is not shown)")
        register_secret(value)
        options[key] = value
    return options


def command_storage_options(pairs: list[str]) -> dict[str, str]:
    """The storage options of prune, discover, export and promoted: TXFLOW_STORAGE_OPTIONS, then the flags
    (which win); every value masked in all later output."""

    options = {k: v.get_secret_value() for k, v in storage_options_from_env().items()}
    for value in options.values():
        register_secret(value)
    return options | _storage_options(pairs)


NESTED_MODELS = {name for name, info in RunConfig.model_fields.items()
                 if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)}


CONFIG_HELP = ("a YAML, TOML or JSON file of these options (field names, nested as `mesh: {tp: 2}`; a group's "
               "options flat or under its name: `group_size: 4` or `rl: {group_size: 4}`); a flag given as well wins")


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
    # The grouped options nested before the merge, so that a flag wins over the file however each spells it.
    return _merged(nest_flat_names(from_file), nest_flat_names(values))


def fields_line(exc: ValidationError) -> str:
    """A config's validation errors in one line: `field: message; ...`."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
