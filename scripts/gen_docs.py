"""Writes the generated parts of the docs site, so that they cannot drift from what they describe:

- `docs/options.md`: one row per flag of `txflow run` (flag, default, description), from the parser that
  `txflow.cli` builds out of `RunConfig`'s fields;
- the SDK matrix of `docs/tinker-api.md` (between its two markers), from `docs/sdk-matrix.json`, the
  data `tests/test_sdk_matrix_e2e.py` reads to know which shims each SDK needs;
- the list of changes to SkyRL-tx in `docs/upstream-patches.md` (between its two markers), from the table
  of `txflow/upstream/skyrl_tx/patches.py`.

`make docs` runs it before building the site; `tests/test_docs.py` fails when a committed page differs
from what it writes now. `--check` only says which page would change (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from txflow import cli
from txflow.config import FLAT_NAMES, RunConfig
from txflow.upstream.skyrl_tx.patches import PATCHES

DOCS = Path(__file__).resolve().parents[1] / "docs"
OPTIONS_PAGE = DOCS / "options.md"
SDK_MATRIX = DOCS / "sdk-matrix.json"
SDK_PAGE = DOCS / "tinker-api.md"
MATRIX_BEGIN = "<!-- sdk-matrix: rendered from docs/sdk-matrix.json by scripts/gen_docs.py; do not edit -->"
MATRIX_END = "<!-- end of sdk-matrix -->"
PATCHES_PAGE = DOCS / "upstream-patches.md"
PATCHES_BEGIN = "<!-- patches: rendered from the table of patches.py by scripts/gen_docs.py; do not edit -->"
PATCHES_END = "<!-- end of patches -->"
REGENERATE = "regenerate with `make docs` (or `.venv/bin/python scripts/gen_docs.py`) and commit the result"

OPTIONS_INTRO = """\
# Options

<!-- Written by scripts/gen_docs.py from RunConfig (txflow/config.py); do not edit: `make docs` rewrites it. -->

`txflow run sft|rl|custom [options]`. Every option is a field of `RunConfig` (`txflow/config.py`), the one
configuration model of a run: the flags, the deployments' parameters and the Prefect UI's form are all
generated from it, and this page is too. A nested field is flattened (`mesh.fsdp` is `--mesh-fsdp`); the
option groups (`rl`, `ray`, `custom`, `export`, each a table below) keep flat names: `--group-size` is
`rl.group_size`, in a file `group_size: 4` or `rl: {group_size: 4}`. Where the default depends on other
options (the mode, the model), the description says how, and the column is empty. `txflow run --help`
shows the same text.

The same options can live in a file, `--config run.yaml` (or `.toml`, `.json`; `txflow run`, `txflow sweep`
and `txflow cluster up` take it), a flag given as well winning:

```yaml
# run.yaml: txflow run sft --config run.yaml --steps 40
base_model: smollm2-135m
dataset: s3://bucket/data/train.jsonl
steps: 20
lora_rank: 16
checkpoints: s3://bucket/runs
storage_options: {endpoint_url: "https://s3.example.com"}
```

A name the model does not know, a file that does not parse, or a `mode:` other than the command's stops
before anything starts, in one line. `txflow sweep` takes these options too, with `--learning-rate` and
`--lora-rank` as comma-separated grids; `txflow cluster up` takes the cluster's fields (see
[Clusters](clusters.md)).
"""
TABLE_HEAD = """| flag | default | description |
| --- | --- | --- |
"""


def _cell(text: str) -> str:
    """Markdown table cell text: a pipe would end the cell."""
    return text.replace("|", "\\|")


def _run_parser() -> argparse.ArgumentParser:
    return cli._parser()._subparsers._group_actions[0].choices["run"]


def _field(dest: str):
    """The pydantic FieldInfo of a dotted field path of RunConfig, or None for a flag that is not a field."""
    model, info = RunConfig, None
    for name in dest.split("."):
        fields = getattr(model, "model_fields", {})
        if name not in fields:
            return None
        info = fields[name]
        model = info.annotation
    return info


def options_page() -> str:
    """docs/options.md as the current `txflow run` parser and RunConfig describe it: the general options, then
    a table per option group (the parser's argument groups)."""
    tables = []
    for group in _run_parser()._action_groups:
        rows = []
        for action in group._group_actions:
            flags = [flag for flag in action.option_strings if flag.startswith("--")]
            if not flags:
                continue
            info = _field(".".join(FLAT_NAMES.get(action.dest, (action.dest,))))
            help_text = action.help or ""
            default = ""
            if info is not None:
                # --help appends the default to the description; here it has a column of its own.
                suffix = cli._default_of(info)
                help_text = help_text.replace(suffix, "", 1) if suffix else help_text
                default = suffix.removeprefix(" (default: ").removesuffix(")")
            names = ", ".join(f"`{flag}`" for flag in flags)
            rows.append(f"| {names} | {_cell(default)} | {_cell(help_text)} |")
        if not rows:
            continue
        title = group.title[0].upper() + group.title[1:]
        heading = "\n" if group.title == "options" else f"\n## {title}\n\n{group.description}\n\n"
        tables.append(heading + TABLE_HEAD + "\n".join(rows) + "\n")
    return OPTIONS_INTRO + "".join(tables)


def shims_text(numbers: list[int]) -> str:
    """`[1, 2, 3, 7]` as "1-3, 7"; runs of three or more as ranges; none as "none"."""
    parts, run = [], []
    for number in sorted(numbers) + [None]:
        if run and number == run[-1] + 1:
            run.append(number)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run)))
        run = [number] if number is not None else []
    return ", ".join(parts) or "none"


def sdk_matrix_table() -> str:
    """The SDK and cookbook table, one row per entry of docs/sdk-matrix.json, between its markers."""
    lines = [MATRIX_BEGIN, "", "| SDK | client | exercised | needs shims |", "| --- | --- | --- | --- |"]
    for row in json.loads(SDK_MATRIX.read_text()):
        sdk = f"`{row['sdk']}`" + (f" ({row['environment']})" if row.get("environment") else "")
        client = f"`python -m {row['module']}`" if row.get("module") else row["client"]
        lines.append(f"| {sdk} | {_cell(client)} | {_cell(row['exercised'])} | {shims_text(row['needs_shims'])} |")
    return "\n".join([*lines, "", MATRIX_END])


def _between(page: Path, begin_marker: str, end_marker: str, text: str, what: str) -> str:
    """`page`'s text with what stands between its two markers replaced by `text` (markers included)."""
    before, begin, rest = page.read_text().partition(begin_marker)
    _, end, after = rest.partition(end_marker)
    if not begin or not end:
        raise SystemExit(f"{page}: the markers {begin_marker!r} and {end_marker!r} are missing; put them back "
                         f"where {what} goes")
    return before + text + after


def sdk_page() -> str:
    """docs/tinker-api.md with its SDK matrix rendered from the data file now."""
    return _between(SDK_PAGE, MATRIX_BEGIN, MATRIX_END, sdk_matrix_table(), "the SDK table")


def patches_list() -> str:
    """One section per change to SkyRL-tx, in the order of the table, between its markers."""
    lines = [PATCHES_BEGIN]
    for patch in PATCHES:
        modules = ", ".join(f"`{module.strip()}`" for module in patch.module.split(","))
        lines += ["", f"### `{patch.slug}`", "", f"Where: {modules}.", "",
                  f"- **Upstream:** {patch.why}", f"- **txflow:** {patch.what}",
                  f"- **Can go when** {patch.until}"]
    return "\n".join([*lines, "", PATCHES_END])


def patches_page() -> str:
    """docs/upstream-patches.md with its list of changes rendered from the table now."""
    return _between(PATCHES_PAGE, PATCHES_BEGIN, PATCHES_END, patches_list(), "the list of changes")


def pages() -> dict[Path, str]:
    """Every generated page and what it should hold now."""
    return {OPTIONS_PAGE: options_page(), SDK_PAGE: sdk_page(), PATCHES_PAGE: patches_page()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page would change")
    args = parser.parse_args(argv)
    wanted = pages()
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    for path in stale:
        if args.check:
            print(f"{path.relative_to(DOCS.parent)} is out of date: {REGENERATE}")
        else:
            path.write_text(wanted[path])
            print(f"wrote {path.relative_to(DOCS.parent)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
