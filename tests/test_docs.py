"""The generated pages of the docs site are what their generator writes now: the options page from
RunConfig and the `txflow run` parser, the SDK matrix from the data file the SDK tests read, the list of
upstream patches from their table (`txflow/upstream/skyrl_tx/patches.py`)."""

from __future__ import annotations

import json

import pytest

from scripts import gen_docs


@pytest.mark.parametrize("page", sorted(gen_docs.pages(), key=str), ids=lambda path: path.name)
def test_a_generated_page_is_what_its_generator_writes_now(page):
    assert page.read_text() == gen_docs.pages()[page], f"{page.name} is out of date: {gen_docs.REGENERATE}"


def test_the_shims_column_is_written_as_ranges():
    assert [gen_docs.shims_text(n) for n in ([], [1, 2], [1, 2, 3], [1, 2, 3, 7], [1, 2, 3, 4, 5, 6, 7])] == [
        "none", "1, 2", "1-3", "1-3, 7", "1-7"]


def test_every_row_of_the_sdk_matrix_names_its_sdk_its_client_and_known_shims():
    rows = json.loads(gen_docs.SDK_MATRIX.read_text())
    assert rows and all(row["sdk"].startswith(("tinker==", "tinker-cookbook==")) for row in rows)
    # A cookbook row is keyed by the module its client runs, an SDK row by its version.
    assert all(bool(row.get("module")) == row["sdk"].startswith("tinker-cookbook==") for row in rows)
    assert all(row.get("module") or row.get("client") for row in rows)
    assert all(set(row["needs_shims"]) <= set(range(1, 8)) for row in rows)  # tinker_compat's shims, 1-7


def test_the_generator_says_how_to_regenerate_a_stale_page(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "options.md"
    stale.write_text("# Options\n")
    monkeypatch.setattr(gen_docs, "pages", lambda: {stale: gen_docs.options_page()})
    monkeypatch.setattr(gen_docs, "DOCS", tmp_path / "docs")
    assert gen_docs.main(["--check"]) == 1
    assert "make docs" in capsys.readouterr().out and stale.read_text() == "# Options\n"
