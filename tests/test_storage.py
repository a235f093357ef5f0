"""Copies in and out of the run root: what is downloaded is what was committed, byte for byte."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from txflow.checkpoints import storage
from txflow.checkpoints.discovery import discover
from txflow.upstream.skyrl_tx.layout import STATE_FILE


def flip_a_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))  # the same size: only the content says it changed


@pytest.mark.parametrize("directory", [True, False], ids=["state directory", "sampler tarball"])
def test_a_byte_changed_after_discovery_is_refused_on_download(tmp_path, directory):
    """Discovery found the checkpoint complete; a byte changes before the import copies it: the copy is
    refused by its MD5, and whatever stood at the destination is not mistaken for it."""
    local = tmp_path / "staging" / ("step-000002" if directory else "step-000002.tar.gz")
    if directory:
        local.mkdir(parents=True)
        (local / STATE_FILE).write_bytes(os.urandom(4096))
        (local / "meta.json").write_text("{}")
    else:
        local.parent.mkdir(parents=True)
        local.write_bytes(os.urandom(4096))
    root = tmp_path / "root"
    kind_dir = "" if directory else "sampler_weights/"
    url = str(root / "m1" / f"{kind_dir}{local.name}")
    storage.upload(local, url, {}, "a test checkpoint")
    [found] = [a for a in discover(str(root), require_commit=True) if a.url == url]
    assert found.complete and found.committed

    flip_a_byte(Path(url) / STATE_FILE if directory else Path(url), 100)
    copy = tmp_path / "copy" / local.name
    with pytest.raises(ValueError, match="is not the committed one"):
        storage.download(url, copy, {}, directory=directory)
    # The same checkpoint untouched downloads and matches.
    flip_a_byte(Path(url) / STATE_FILE if directory else Path(url), 100)
    storage.download(url, copy, {}, directory=directory)
    original = (local / STATE_FILE) if directory else local
    assert ((copy / STATE_FILE) if directory else copy).read_bytes() == original.read_bytes()
