"""Copies in and out of the run root: what is downloaded is what was committed, byte for byte."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import uuid
from pathlib import Path

import fsspec
import pytest

from tests.helpers import fresh_root
from txflow.checkpoints import storage
from txflow.checkpoints.discovery import discover
from txflow.checkpoints.markers import (
    COMMIT_SUFFIX,
    SIGNING_KEY_BLOCK_ENV,
    SIGNING_KEY_ENV,
    check_signature,
    commit_record,
    md5_of,
)
from txflow.config import RunConfig
from txflow.log import scrub
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


# --- what a bucket writer adds is never downloaded ------------------------------------------------------


def committed_states(root: str, tmp_path: Path, steps=(2, 4)) -> dict[int, str]:
    """Committed txflow states of a run under `root` (any fsspec URL): {step: url}."""
    urls = {}
    for step in steps:
        local = tmp_path / "staging" / f"step-{step:06d}"
        local.mkdir(parents=True)
        (local / STATE_FILE).write_bytes(os.urandom(2048))
        urls[step] = storage.upload(local, f"{root}/m1/step-{step:06d}.tar.gz", {}, f"step {step}")
    return urls


@pytest.fixture
def memory_root():
    yield from fresh_root("memory", Path("unused"))


def test_a_traversal_key_under_a_committed_state_is_refused_and_nothing_is_written_outside(tmp_path, memory_root):
    """An object store keeps `..` in a key: one more key under the newest committed state, as a bucket writer
    adds it, must not make the checkpoint complete, nor its download write where the key points."""
    urls = committed_states(memory_root, tmp_path)
    fs, path = fsspec.core.url_to_fs(urls[4])
    fs.pipe_file(f"{path}/../../../PWNED", b"import os  # code in a .pth runs at every start")
    destination = tmp_path / "a" / "b" / "staging" / "step-000004"  # `../../..` from it is tmp_path / "a"

    found = {a.url: a for a in discover(memory_root, require_commit=True)}
    assert not found[urls[4]].complete and not found[urls[4]].committed
    assert "'../../../PWNED' is not recorded in the commit marker" in found[urls[4]].reason
    assert storage.latest_state(memory_root).url == urls[2]  # never the changed one
    with pytest.raises(ValueError, match=r"'\.\./\.\./\.\./PWNED' is not recorded in its commit marker"):
        storage.download(urls[4], destination, {}, directory=True)
    assert [p for p in tmp_path.rglob("PWNED")] == [] and not destination.exists()


def test_a_file_added_to_a_local_state_is_refused_and_what_stood_at_the_destination_stays(tmp_path):
    urls = committed_states(str(tmp_path / "root"), tmp_path)
    (Path(urls[4]) / "sitecustomize.py").write_text("print('not committed')")
    destination = tmp_path / "copy"
    destination.mkdir()
    (destination / "kept").write_text("earlier")

    [state] = [a for a in discover(str(tmp_path / "root")) if a.url == urls[4]]
    assert not state.complete and "'sitecustomize.py' is not recorded" in state.reason
    with pytest.raises(ValueError, match="'sitecustomize.py' is not recorded in its commit marker"):
        storage.download(urls[4], destination, {}, directory=True)
    assert sorted(p.name for p in destination.iterdir()) == ["kept"]
    # Untouched, the same checkpoint downloads exactly its recorded files.
    storage.download(urls[2], destination, {}, directory=True)
    assert sorted(p.name for p in destination.iterdir()) == [STATE_FILE]


@pytest.mark.parametrize("files", [{}, {"../../PWNED": {"size": 4, "md5": "0" * 32}},
                                   {"/abs/PWNED": {"size": 4, "md5": "0" * 32}},
                                   {"a//b": {"size": 4, "md5": "0" * 32}}],
                         ids=["no file", "dot-dot", "absolute", "empty segment"])
def test_a_marker_that_records_nothing_or_a_path_outside_certifies_nothing(tmp_path, memory_root, files):
    urls = committed_states(memory_root, tmp_path, steps=(2,))
    fs, path = fsspec.core.url_to_fs(urls[2])
    fs.pipe_file(path + COMMIT_SUFFIX, json.dumps({"format": 3, "verify": "read", "bytes": 4, "files": files}).encode())

    [state] = discover(memory_root, require_commit=True)
    assert not state.complete and not state.committed and "commit marker" in state.reason
    assert storage.latest_state(memory_root) is None
    with pytest.raises(ValueError, match="commit marker records"):
        storage.download(urls[2], tmp_path / "a" / "copy", {}, directory=True)
    assert [p for p in tmp_path.rglob("PWNED")] == [] and not (tmp_path / "a").exists()


# --- signed commits -------------------------------------------------------------------------------------

KEY = "signing-key-of-this-team-0123456789"


def forge(url: str, content: bytes) -> None:
    """What a bucket writer can do: replace a state's file and rewrite its marker to match (sizes, MD5s)."""
    fs, path = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{path}/{STATE_FILE}", content)
    fs.pipe_file(path + COMMIT_SUFFIX, commit_record({STATE_FILE: (len(content), md5_of(content))}))


def test_a_marker_forged_by_a_bucket_writer_is_accepted_without_a_key_and_refused_with_one(tmp_path, memory_root,
                                                                                           monkeypatch):
    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    urls = committed_states(memory_root, tmp_path)
    storage.download(urls[4], tmp_path / "signed", {}, directory=True)  # signed with the key: read back
    forge(urls[4], b"the writer's weights")
    cfg = RunConfig(run_id="next", checkpoints=str(tmp_path / "ckpt"), resume_from=memory_root).resolved()

    monkeypatch.delenv(SIGNING_KEY_ENV)  # no key: MD5 alone cannot tell the forgery
    storage.download(urls[4], tmp_path / "unsigned", {}, directory=True)
    assert (tmp_path / "unsigned" / STATE_FILE).read_bytes() == b"the writer's weights"
    assert storage.resolve_resume_from(cfg) == (urls[4], 4)

    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    [state] = [a for a in discover(memory_root) if a.url == urls[4]]
    assert not state.committed and "its commit marker is not signed" in state.reason  # not ours: no commit
    with pytest.raises(ValueError, match=f"^{urls[4]}: its commit marker is not signed"):
        storage.download(urls[4], tmp_path / "refused", {}, directory=True)
    assert storage.resolve_resume_from(cfg) == (urls[2], 2)  # from the root: the newest state signed with it
    assert not (tmp_path / "refused").exists()
    # Signed with another key, or a genuine marker copied onto another checkpoint's name: refused too.
    monkeypatch.setenv(SIGNING_KEY_ENV, "another-key-0123456789abcdef")
    with pytest.raises(ValueError, match="signed with another key"):
        storage.download(urls[2], tmp_path / "refused", {}, directory=True)
    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    fs, step2 = fsspec.core.url_to_fs(urls[2])
    step4 = fsspec.core.url_to_fs(urls[4])[1]
    fs.pipe_file(f"{step4}/{STATE_FILE}", fs.cat_file(f"{step2}/{STATE_FILE}"))
    fs.pipe_file(step4 + COMMIT_SUFFIX, fs.cat_file(step2 + COMMIT_SUFFIX))
    with pytest.raises(ValueError, match=r"signed for '.*/m1/step-000002\.tar\.gz', not for where it is stored "
                                         r"\('.*/m1/step-000004\.tar\.gz'\)"):
        storage.download(urls[4], tmp_path / "refused", {}, directory=True)


def run_checkpoints(checkpoints: str, tmp_path: Path, run_id: str) -> dict[str, str]:
    """What a run commits under `<checkpoints>/<run_id>`, as the flow commits it: a state and a PEFT export,
    each signed for its path below the checkpoint root ({"state": url, "peft": url})."""
    local = tmp_path / f"staging-{run_id}"
    (local / "step-000002").mkdir(parents=True)
    (local / "step-000002" / STATE_FILE).write_bytes(f"{run_id}'s state".encode())
    (local / "peft").mkdir()
    (local / "peft" / "adapter_model.safetensors").write_bytes(f"{run_id}-weights".encode())
    cfg = RunConfig(run_id=run_id, checkpoints=checkpoints).resolved()
    return {"state": storage.upload(local / "step-000002", f"{cfg.run_root}/m1/step-000002.tar.gz", {}, "a state",
                                    signed_as=f"{run_id}/m1/step-000002.tar.gz"),
            "peft": storage.upload(local / "peft", f"{cfg.run_root}/export/peft", {}, "an export",
                                   signed_as=f"{run_id}/export/peft")}


@pytest.mark.parametrize("artifact", ["peft", "state"])
def test_a_signed_checkpoint_copied_over_another_runs_same_name_is_refused_naming_both(tmp_path, memory_root,
                                                                                      monkeypatch, artifact):
    """The attack reproduced: every export ends in `peft` and state names repeat across
    runs, so a signature that bound only the last name let run B's export, copied with its marker over run A's,
    be read as A's. Signed for `<run id>/export/peft`, it is refused there, in one line naming both paths; the
    whole checkpoint root copied elsewhere still reads back."""
    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    a, b = run_checkpoints(memory_root, tmp_path, "run-a"), run_checkpoints(memory_root, tmp_path, "run-b")
    file = "adapter_model.safetensors" if artifact == "peft" else STATE_FILE
    fs, a_path = fsspec.core.url_to_fs(a[artifact])
    b_path = fsspec.core.url_to_fs(b[artifact])[1]
    moved = f"memory://moved-{uuid.uuid4().hex}"
    fs.copy(fsspec.core.url_to_fs(memory_root)[1], fsspec.core.url_to_fs(moved)[1], recursive=True)
    storage.download(a[artifact].replace(memory_root, moved), tmp_path / "moved", {}, directory=True)
    assert (tmp_path / "moved" / file).read_bytes().startswith(b"run-a")
    fs.rm(fsspec.core.url_to_fs(moved)[1], recursive=True)

    fs.pipe_file(f"{a_path}/{file}", fs.cat_file(f"{b_path}/{file}"))
    fs.pipe_file(a_path + COMMIT_SUFFIX, fs.cat_file(b_path + COMMIT_SUFFIX))
    below = "export/peft" if artifact == "peft" else "m1/step-000002.tar.gz"
    with pytest.raises(ValueError) as refused:
        storage.download(a[artifact], tmp_path / "refused", {}, directory=True)
    message = str(refused.value)
    assert "\n" not in message and f"signed for 'run-b/{below}'" in message and f"/run-a/{below}'" in message
    assert not (tmp_path / "refused").exists()
    monkeypatch.delenv(SIGNING_KEY_ENV)  # without a key nothing can tell, as docs/storage-and-integrity.md says
    storage.download(a[artifact], tmp_path / "unsigned", {}, directory=True)
    assert (tmp_path / "unsigned" / file).read_bytes().startswith(b"run-b")


def test_a_marker_signed_for_its_last_name_only_is_refused(tmp_path, memory_root, monkeypatch):
    """An earlier txflow signed the record and the last name only: such a marker cannot say which run it
    belongs to, so with a key it is not read (one line saying why)."""
    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    url = run_checkpoints(memory_root, tmp_path, "run-a")["peft"]
    fs, path = fsspec.core.url_to_fs(url)
    record = json.loads(fs.cat_file(path + COMMIT_SUFFIX))
    del record["path"], record["hmac"]
    body = json.dumps(record, indent=1, sort_keys=True).encode()
    record["hmac"] = hmac.new(KEY.encode(), b"peft\n" + body, hashlib.sha256).hexdigest()  # the old scheme
    fs.pipe_file(path + COMMIT_SUFFIX, json.dumps(record, indent=1, sort_keys=True).encode())
    with pytest.raises(ValueError, match="signed for its last name only"):
        storage.download(url, tmp_path / "refused", {}, directory=True)


def test_with_a_key_a_sizes_only_marker_is_refused_and_the_key_never_shows(tmp_path, memory_root, monkeypatch):
    urls = committed_states(memory_root, tmp_path, steps=(2,))
    fs, path = fsspec.core.url_to_fs(urls[2])
    fs.pipe_file(path + COMMIT_SUFFIX, json.dumps({"files": {STATE_FILE: fs.size(f"{path}/{STATE_FILE}")}}).encode())
    storage.download(urls[2], tmp_path / "old", {}, directory=True)  # an earlier txflow's marker, no key: as before

    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    with pytest.raises(ValueError, match="not signed"):
        storage.download(urls[2], tmp_path / "refused", {}, directory=True)
    assert scrub(f"key {KEY}") == "key ***"
    monkeypatch.setenv(SIGNING_KEY_ENV, "short")
    with pytest.raises(ValueError, match="has 5 characters; use at least 16"):
        storage.download(urls[2], tmp_path / "refused", {}, directory=True)


def test_the_key_can_come_from_a_prefect_secret_block(tmp_path, memory_root, monkeypatch):
    """Deployments keep the key in a Prefect Secret block that TXFLOW_SIGNING_KEY_BLOCK names (the Prefect API
    is stood in for here; a block that cannot be read stops the run, never lets it go on unsigned)."""
    from prefect.blocks.system import Secret

    class Stored:
        def get(self):
            return KEY

    def load(name):
        if name != "txflow-signing-key":
            raise ValueError(f"Unable to find block document named {name}")
        return Stored()

    monkeypatch.setattr(Secret, "load", load)
    monkeypatch.delenv(SIGNING_KEY_ENV, raising=False)
    monkeypatch.setenv(SIGNING_KEY_BLOCK_ENV, "txflow-signing-key")
    urls = committed_states(memory_root, tmp_path, steps=(2,))
    fs, path = fsspec.core.url_to_fs(urls[2])
    check_signature(fs.cat_file(path + COMMIT_SUFFIX), path, KEY.encode(), urls[2])  # the block's key
    storage.download(urls[2], tmp_path / "copy", {}, directory=True)
    monkeypatch.setenv(SIGNING_KEY_BLOCK_ENV, "no-such-block")
    with pytest.raises(ValueError, match="TXFLOW_SIGNING_KEY_BLOCK=no-such-block: cannot read that Prefect Secret"):
        storage.download(urls[2], tmp_path / "copy", {}, directory=True)
