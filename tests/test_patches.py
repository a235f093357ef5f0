"""The table of changes to SkyRL-tx (`txflow/upstream/skyrl_tx/patches.py`) names each change once, by a slug,
and the code, tests and docs name changes only by the slugs it holds."""

from __future__ import annotations

import re
from pathlib import Path

from txflow.upstream.skyrl_tx.patches import BY_SLUG, PATCHES

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "txflow" / "upstream" / "skyrl_tx"
KEBAB = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)+")
# Backticked kebab-case names in the adapter that are not patches.
NOT_PATCHES = {"smollm2-135m"}
# "the `a` change", "the `a`, `b` and `c` changes"
_ONE = "`" + KEBAB.pattern + "`"
NAMED_AS_CHANGES = re.compile(rf"((?:{_ONE}(?:,\s+and\s+|,\s+|\s+and\s+))*{_ONE})\s+changes?\b")


def _texts(*folders: str, suffixes=(".py", ".md")):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in suffixes and path.is_file():
                yield path, path.read_text()


def test_every_slug_is_unique_kebab_case_and_every_field_is_written():
    slugs = [patch.slug for patch in PATCHES]
    assert len(slugs) == len(set(slugs)) == len(BY_SLUG)
    assert all(KEBAB.fullmatch(slug) for slug in slugs), slugs
    assert all(patch.what and patch.why and patch.until and patch.module for patch in PATCHES)


def test_every_module_a_patch_names_exists():
    for patch in PATCHES:
        for module in (name.strip() for name in patch.module.split(",")):
            path = ROOT / (module.replace(".", "/") + ".py") if "." in module else ADAPTER / f"{module}.py"
            assert path.is_file(), f"{patch.slug}: no module {module} ({path.relative_to(ROOT)})"


def test_every_slug_named_as_a_patch_is_in_the_table():
    named = {}
    for path, text in _texts("txflow", "tests", "scripts", "docs"):
        for names in NAMED_AS_CHANGES.findall(text):
            found = set(re.findall(r"`(" + KEBAB.pattern + r")`", names))
            named.update({slug: path.relative_to(ROOT) for slug in found if slug not in named})
        found = set()
        found |= set(re.findall(r"upstream-patches\.md#(" + KEBAB.pattern + r")", text))
        if path.parent == ADAPTER or path.name == "upstream-patches.md":
            found |= set(re.findall(r"`(" + KEBAB.pattern + r")`", text)) - NOT_PATCHES
        for slug in found:
            named.setdefault(slug, path.relative_to(ROOT))
    unknown = {slug: str(path) for slug, path in named.items() if slug not in BY_SLUG}
    assert not unknown, f"slugs named as patches but missing from patches.PATCHES: {unknown}"
    assert set(BY_SLUG) <= set(named)  # and every change is named somewhere besides the table


def test_no_change_is_named_by_a_number():
    numbered = re.compile(r"\b(?:adapter )?points? \d|adapter point|\(\d{1,2}\.\)", re.IGNORECASE)
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
            for path, text in _texts("txflow", "tests", "docs", "scripts")
            if path != Path(__file__).resolve()
            for number, line in enumerate(text.splitlines(), 1) if numbered.search(line)]
    assert not hits, "name the change by its slug (txflow/upstream/skyrl_tx/patches.py):\n" + "\n".join(hits)


def test_no_comment_or_docstring_cites_a_tracker_number():
    tracker = re.compile(r"\bissues? \d+", re.IGNORECASE)  # an upstream "issue #1362" cited as a source stays
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
            for folder in ("txflow", "tests", "scripts", "flows", "tasks", "deployments", "docs")
            for path, text in _texts(folder)
            if path != Path(__file__).resolve()
            for number, line in enumerate(text.splitlines(), 1) if tracker.search(line)]
    assert not hits, "say what the code does and why, not which tracker item asked for it:\n" + "\n".join(hits)
