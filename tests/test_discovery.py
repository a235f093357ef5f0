"""Unit tests of txflow.checkpoints.discovery, on a local directory and on fsspec's memory filesystem."""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import posixpath
import tarfile
import uuid
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tests.helpers import fresh_root
from txflow.checkpoints.discovery import discover, write_manifest
from txflow.checkpoints.markers import COMMIT_SUFFIX, commit_record, write_commit
from txflow.upstream.skyrl_tx.layout import STATE_FILE

pytestmark = [pytest.mark.together]


# --- fixtures and helpers ------------------------------------------------------


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    """A run root that does not exist yet: a local path, or a unique memory:// URL removed afterwards."""
    yield from fresh_root(request.param, tmp_path / "run")


@pytest.fixture(scope="session")
def orbax_files(tmp_path_factory) -> dict[str, bytes]:
    """{relative path: content} of a real Orbax checkpoint, saved the way SkyRL-tx's save_state does."""
    import jax.numpy as jnp
    from flax.training import checkpoints

    ckpt_dir = tmp_path_factory.mktemp("orbax") / "final.tar.gz"
    ckpt_dir.mkdir()
    checkpoints.save_checkpoint_multiprocess(
        target={"w": jnp.ones((4, 4)), "cfg": {"rank": 1}},
        ckpt_dir=str(ckpt_dir),
        step=0,
        prefix="checkpoint_",
        overwrite=True,
    )
    files = {p.relative_to(ckpt_dir).as_posix(): p.read_bytes() for p in ckpt_dir.rglob("*") if p.is_file()}
    assert "checkpoint_0/commit_success.txt" in files  # the layout the classifier relies on
    return files


def put(root: str, rel: str, data: bytes) -> None:
    """Write one file under the root through fsspec, creating parent dirs where that matters (local)."""
    fs, path = fsspec.core.url_to_fs(f"{root}/{rel}")
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    fs.pipe_file(path, data)


def put_tree(root: str, prefix: str, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        put(root, f"{prefix}/{rel}", data)


def remove(root: str, rel: str) -> None:
    fs, path = fsspec.core.url_to_fs(f"{root}/{rel}")
    fs.rm(path)


def tarball(members: int = 4, mode: str = "w:gz") -> bytes:
    """A real tarball of incompressible members, so any cut lands inside real data."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tar:
        for i in range(members):
            data = os.urandom(5000)
            info = tarfile.TarInfo(f"member-{i}.bin")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def by_path(artifacts) -> dict:
    return {a.path: a for a in artifacts}


# --- classification --------------------------------------------------------------


def test_sampler_tarball_is_one_complete_artifact_and_probe_is_hidden(root):
    blob = tarball(members=3)
    put(root, "m1/sampler_weights/final.tar.gz", blob)
    put(root, "m1/sampler_weights/final.tar.gz.probe", b"ok")

    [artifact] = discover(root)

    assert (artifact.kind, artifact.format) == ("sampler", "tarball")
    assert artifact.path == "m1/sampler_weights/final.tar.gz"
    assert artifact.url == f"{root}/m1/sampler_weights/final.tar.gz"
    assert artifact.complete and artifact.reason is None
    assert artifact.files == 3
    assert artifact.bytes == len(blob)


def test_orbax_directory_is_one_complete_state_artifact(root, orbax_files):
    put_tree(root, "m1/final.tar.gz", orbax_files)

    [artifact] = discover(root)

    assert (artifact.kind, artifact.format) == ("state", "directory")
    assert artifact.path == "m1/final.tar.gz"
    assert artifact.url == f"{root}/m1/final.tar.gz"
    assert artifact.complete, artifact.reason
    assert artifact.bytes == sum(len(data) for data in orbax_files.values())
    assert artifact.files == len(orbax_files)


def test_txflow_state_directory_is_one_complete_state_artifact(root):
    put(root, "m1/step-000004.tar.gz/txflow-state.msgpack", b"s" * 100)
    put(root, "m1/step-000008.tar.gz/txflow-state.msgpack.partial", b"s" * 40)  # a save cut short

    done, cut = discover(root)

    assert (done.kind, done.format, done.path, done.files, done.bytes) == (
        "state", "directory", "m1/step-000004.tar.gz", 1, 100)
    assert done.complete, done.reason
    assert (cut.kind, cut.path, cut.complete) == ("state", "m1/step-000008.tar.gz", False)
    assert "did not finish" in cut.reason


def test_plain_directory_gives_one_file_artifact_per_file(root):
    put(root, "logs/metrics.jsonl", b'{"loss": 1.0}\n')
    put(root, "logs/report.json", b"{}")

    artifacts = discover(root)

    assert [a.path for a in artifacts] == ["logs/metrics.jsonl", "logs/report.json"]
    assert all((a.kind, a.format, a.files, a.complete) == ("file", "file", 1, True) for a in artifacts)
    assert artifacts[1].bytes == 2


def test_tarball_outside_sampler_weights_is_a_file_kind_tarball(root):
    put(root, "exports/bundle.tgz", tarball(members=2))

    [artifact] = discover(root)

    assert (artifact.kind, artifact.format, artifact.files, artifact.complete) == ("file", "tarball", 2, True)


def test_artifacts_are_sorted_by_path(root, orbax_files):
    put(root, "z.txt", b"z")
    put_tree(root, "m1/final.tar.gz", orbax_files)
    put(root, "m1/sampler_weights/final.tar.gz", tarball())
    put(root, "a.txt", b"a")

    assert [a.path for a in discover(root)] == [
        "a.txt",
        "m1/final.tar.gz",
        "m1/sampler_weights/final.tar.gz",
        "z.txt",
    ]


# --- incomplete artifacts ----------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "cut"),
    [
        ("w:gz", lambda n: n // 2),  # first half of the bytes
        ("w:gz", lambda n: n - 4),  # only the gzip trailer is cut: tarfile's "r|*" alone misses it
        ("w", lambda n: 512 + 5120),  # plain tar cut right after its first member: "r|*" misses it too
    ],
    ids=["gzip-half", "gzip-trailer", "tar-member-boundary"],
)
def test_truncated_tarball_is_incomplete(root, mode, cut):
    blob = tarball(members=4, mode=mode)
    put(root, "m1/sampler_weights/final.tar.gz", blob[: cut(len(blob))])

    [artifact] = discover(root)

    assert not artifact.complete
    assert "truncated or corrupt" in artifact.reason
    assert artifact.files is None


def test_unverified_tarball_is_taken_as_is(root):
    blob = tarball()
    put(root, "m1/sampler_weights/final.tar.gz", blob[: len(blob) // 2])

    [artifact] = discover(root, verify_tarballs=False)

    assert artifact.complete and artifact.kind == "sampler"


def test_orbax_directory_without_finished_marker_is_incomplete(root, orbax_files):
    files = {rel: data for rel, data in orbax_files.items() if not rel.endswith("commit_success.txt")}
    put_tree(root, "m1/final.tar.gz", files)

    [artifact] = discover(root)

    assert artifact.kind == "state" and artifact.path == "m1/final.tar.gz"
    assert not artifact.complete
    assert "commit_success.txt" in artifact.reason


def test_orbax_temporary_directory_is_incomplete(root, orbax_files):
    # What a save interrupted before Orbax's final rename leaves on a local disk:
    # the tmp dir already holds commit_success.txt.
    files = {rel.replace("checkpoint_0/", "checkpoint_0.orbax-checkpoint-tmp/"): d for rel, d in orbax_files.items()}
    put_tree(root, "m1/final.tar.gz", files)

    [artifact] = discover(root)

    assert artifact.path == "m1/final.tar.gz"
    assert not artifact.complete
    assert "temporary directory" in artifact.reason


def test_missing_root_raises(root):
    with pytest.raises(FileNotFoundError, match="Nothing was found") as excinfo:
        discover(root)
    assert root in str(excinfo.value)


def test_empty_root_raises(root):
    fs, path = fsspec.core.url_to_fs(root)
    fs.makedirs(path, exist_ok=True)

    with pytest.raises(FileNotFoundError, match="Nothing was found") as excinfo:
        discover(root)
    assert root in str(excinfo.value)


# --- commit sidecars -----------------------------------------------------------------


def test_committed_artifacts_pass_require_commit(root, orbax_files):
    put_tree(root, "m1/final.tar.gz", orbax_files)
    put(root, "m1/sampler_weights/final.tar.gz", tarball())
    write_commit(f"{root}/m1/final.tar.gz")
    write_commit(f"{root}/m1/sampler_weights/final.tar.gz")

    artifacts = discover(root, require_commit=True)

    assert [a.path for a in artifacts] == ["m1/final.tar.gz", "m1/sampler_weights/final.tar.gz"]
    assert all(a.committed and a.complete for a in artifacts), [a.reason for a in artifacts]


def test_sidecar_records_every_file_with_its_size_and_md5(root, orbax_files):
    put_tree(root, "m1/final.tar.gz", orbax_files)
    write_commit(f"{root}/m1/final.tar.gz")

    with fsspec.open(f"{root}/m1/final.tar.gz{COMMIT_SUFFIX}") as f:
        record = json.load(f)

    assert record["files"] == {rel: {"size": len(data), "md5": hashlib.md5(data).hexdigest()}
                               for rel, data in orbax_files.items()}
    assert record["bytes"] == sum(len(data) for data in orbax_files.values()) and record["format"] == 3
    assert record["verify"] == "read"  # digests computed from the stored files: no ETag vouched for them
    # Canonical: the same files give the same bytes, so an object store's MD5 ETag can vouch for it.
    with fsspec.open(f"{root}/m1/final.tar.gz{COMMIT_SUFFIX}", "rb") as f:
        assert f.read() == commit_record({n: (e["size"], e["md5"]) for n, e in record["files"].items()}, "read")


@pytest.mark.parametrize("artifact", ["m1/final.tar.gz/checkpoint_0/_METADATA", "m1/sampler_weights/final.tar.gz"])
def test_a_byte_changed_after_the_commit_makes_the_checkpoint_incomplete(root, orbax_files, artifact):
    """Same size, other content: the marker's digest catches what its sizes cannot."""
    put_tree(root, "m1/final.tar.gz", orbax_files)
    put(root, "m1/sampler_weights/final.tar.gz", tarball())
    write_commit(f"{root}/m1/final.tar.gz")
    write_commit(f"{root}/m1/sampler_weights/final.tar.gz")
    fs, path = fsspec.core.url_to_fs(f"{root}/{artifact}")
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))

    found = by_path(discover(root, require_commit=True))

    damaged = next(a for p, a in found.items() if artifact.startswith(p))
    assert not damaged.complete and not damaged.committed
    assert "the stored copy is not the committed one" in damaged.reason
    assert all(a.complete for a in found.values() if a is not damaged)


def test_a_sizes_only_marker_of_an_earlier_txflow_is_still_accepted(root, orbax_files):
    put_tree(root, "m1/final.tar.gz", orbax_files)
    put(root, "m1/final.tar.gz" + COMMIT_SUFFIX,
        json.dumps({"files": {rel: len(data) for rel, data in orbax_files.items()}}).encode())

    [artifact] = discover(root, require_commit=True)

    assert artifact.complete and artifact.committed


def test_missing_sidecar_fails_only_with_require_commit(root):
    put(root, "m1/sampler_weights/final.tar.gz", tarball())
    put(root, "metrics.jsonl", b"{}\n")

    relaxed = by_path(discover(root))
    strict = by_path(discover(root, require_commit=True))

    assert relaxed["m1/sampler_weights/final.tar.gz"].complete
    sampler = strict["m1/sampler_weights/final.tar.gz"]
    assert not sampler.complete and not sampler.committed
    assert "no commit marker" in sampler.reason
    assert strict["metrics.jsonl"].complete  # plain files never need a commit


def test_sidecar_listing_a_deleted_file_is_incomplete(root, orbax_files):
    put_tree(root, "m1/final.tar.gz", orbax_files)
    write_commit(f"{root}/m1/final.tar.gz")
    remove(root, "m1/final.tar.gz/checkpoint_0/_sharding")

    [artifact] = discover(root)

    assert not artifact.complete and not artifact.committed
    assert "checkpoint_0/_sharding" in artifact.reason


def test_sidecar_with_other_size_is_incomplete(root):
    put(root, "m1/sampler_weights/final.tar.gz", tarball(members=2))
    write_commit(f"{root}/m1/sampler_weights/final.tar.gz")
    put(root, "m1/sampler_weights/final.tar.gz", tarball(members=3))

    [artifact] = discover(root)

    assert not artifact.complete and not artifact.committed
    assert "final.tar.gz" in artifact.reason


# --- I/O budget and manifest -------------------------------------------------------------


def test_discover_lists_the_root_exactly_once(root, orbax_files, monkeypatch):
    put_tree(root, "m1/final.tar.gz", orbax_files)
    put(root, "m1/sampler_weights/final.tar.gz", tarball())
    put(root, "m1/sampler_weights/final.tar.gz.probe", b"ok")
    put(root, "logs/metrics.jsonl", b"{}\n")
    write_commit(f"{root}/m1/final.tar.gz")

    # Count the metadata calls discover() makes itself; those made inside
    # find/open/cat_file are the filesystem's own business.
    fs_class = type(fsspec.core.url_to_fs(root)[0])
    calls: collections.Counter[str] = collections.Counter()
    depth = [0]

    def count(name: str, opens_scope: bool) -> None:
        original = getattr(fs_class, name)

        def wrapper(self, *args, **kwargs):
            if depth[0] == 0:
                calls[name] += 1
            depth[0] += opens_scope
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= opens_scope

        monkeypatch.setattr(fs_class, name, wrapper)

    for name in ("find", "open", "cat_file"):
        count(name, opens_scope=True)
    for name in ("ls", "info", "exists", "isdir", "isfile", "walk", "glob"):
        count(name, opens_scope=False)

    artifacts = discover(root)

    assert len(artifacts) == 3
    assert calls["find"] == 1
    assert not {n: c for n, c in calls.items() if n not in ("find", "open", "cat_file")}
    # Without MD5 ETags (local disk, memory) each committed file is read for its digest, and the
    # uncommitted tarball to its end; the sidecar is read with cat_file. (On S3: nothing, see test_s3_e2e.)
    assert calls["open"] == len(orbax_files) + 1


def test_write_manifest_lists_every_artifact_and_discovery_never_lists_the_manifest(root, orbax_files):
    put_tree(root, "m1/final.tar.gz", orbax_files)
    put(root, "m1/sampler_weights/final.tar.gz", tarball())
    put(root, "logs/metrics.jsonl", b"{}\n")
    artifacts = discover(root)

    url = write_manifest(root, artifacts)

    assert url == f"{root}/manifest.json"
    with fsspec.open(url) as f:
        manifest = json.load(f)
    assert manifest["root"] == root
    assert [a["path"] for a in manifest["artifacts"]] == [a.path for a in artifacts]
    assert manifest["artifacts"][0] == artifacts[0].model_dump()

    # A discovery that sees the manifest does not list it: it is the listing, not an artifact, so the
    # report of a run that discovers again (after its export) and its manifest list the same artifacts.
    again = by_path(discover(root))
    assert set(again) == {a.path for a in artifacts}
    write_manifest(root, list(again.values()))
    with fsspec.open(url) as f:
        assert [a["path"] for a in json.load(f)["artifacts"]] == [a.path for a in artifacts]


def test_local_root_keeps_the_path_as_given(tmp_path):
    put(str(tmp_path), "m1/sampler_weights/final.tar.gz", tarball())

    [artifact] = discover(str(tmp_path))

    assert artifact.url == str(Path(tmp_path) / "m1/sampler_weights/final.tar.gz")


# --- stores whose ETags are not the MD5 of the content ----------------------------------------------------


class EncryptingStore(MemoryFileSystem):
    """Memory, listed the way an SSE-KMS (or SSE-C) bucket lists objects: every object has an ETag of 32 hex
    digits that is not the MD5 of its content. moto does not emulate this, so the listing is patched here."""

    protocol = "kmsmem"

    def info(self, path, **kwargs):
        info = dict(super().info(path, **kwargs))
        if info.get("type") == "file":
            info["ETag"] = '"' + hashlib.md5(b"kms:" + path.encode()).hexdigest() + '"'
        return info

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        found = super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=True, **kwargs)
        found = {p: self.info(p) for p in found}
        return found if detail else sorted(found)


fsspec.register_implementation("kmsmem", EncryptingStore, clobber=True)


def test_a_store_whose_etags_are_not_md5s_commits_by_reading_back_and_verifies_by_reading(tmp_path):
    from txflow.checkpoints import storage

    root = f"kmsmem://kms-{uuid.uuid4().hex}"
    state = tmp_path / "step-000002.tar.gz"
    state.mkdir()
    (state / STATE_FILE).write_bytes(b"weights " * 1000)
    try:
        url = storage.upload(state, f"{root}/m1/step-000002.tar.gz", {}, "a state")
        record = json.loads(fsspec.filesystem("kmsmem").cat_file(f"{url}{COMMIT_SUFFIX}"))
        assert record["verify"] == "read"  # the ETags could not vouch for the bytes: they were read back
        [artifact] = discover(root, require_commit=True)
        assert artifact.complete and artifact.committed, artifact.reason
        # A byte changed, same size: every file is read (the ETags say nothing), so it is caught.
        fs = fsspec.filesystem("kmsmem")
        stored = f"{url}/{STATE_FILE}"
        data = bytearray(fs.cat_file(stored))
        data[10] ^= 0xFF
        fs.pipe_file(stored, bytes(data))
        [changed] = discover(root, require_commit=True)
        assert not changed.complete and "MD5" in changed.reason
    finally:
        fsspec.filesystem("kmsmem").rm(root, recursive=True)


class Md5EtagStore(MemoryFileSystem):
    """An in-memory store that lists each file with its MD5 as ETag, as S3 does for a single-part upload."""

    protocol = "md5mem"

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        found = super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=True, **kwargs)
        for p, info in found.items():
            if info.get("type") == "file":
                info["ETag"] = hashlib.md5(self.cat_file(p)).hexdigest()
        return found if detail else sorted(found)


def test_on_a_store_with_md5_etags_the_marker_trusts_the_listing():
    fsspec.register_implementation("md5mem", Md5EtagStore, clobber=True)
    root = f"md5mem://md5-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("md5mem")
    fs.pipe_file(f"{root}/m1/sampler_weights/s.tar.gz", b"tarball bytes")
    try:
        expected = {"s.tar.gz": (13, hashlib.md5(b"tarball bytes").hexdigest())}
        assert write_commit(f"{root}/m1/sampler_weights/s.tar.gz", expected=expected) == "etag"
        # A wrong expectation is refused, not committed.
        with pytest.raises(OSError, match="incomplete"):
            write_commit(f"{root}/m1/sampler_weights/s.tar.gz", expected={"s.tar.gz": (13, "0" * 32)})
    finally:
        fs.rm(root, recursive=True)


def test_a_signed_checkpoint_is_still_verified_from_the_listing_alone(tmp_path, monkeypatch):
    """With a signing key, the marker's ETag is the MD5 of the signed record the listed files give: the listing
    still proves a committed checkpoint, its signature included, without reading its marker."""
    from txflow.checkpoints import storage
    from txflow.checkpoints.markers import SIGNING_KEY_ENV

    class Md5Store(Md5EtagStore):
        protocol = "md5sig"
        reads: list = []

        def cat(self, path, *args, **kwargs):
            Md5Store.reads.append(path)
            return super().cat(path, *args, **kwargs)

    fsspec.register_implementation("md5sig", Md5Store, clobber=True)
    root = f"md5sig://sig-{uuid.uuid4().hex}"
    state = tmp_path / "step-000002.tar.gz"
    state.mkdir()
    (state / STATE_FILE).write_bytes(os.urandom(1000))
    try:
        monkeypatch.setenv(SIGNING_KEY_ENV, "signing-key-of-this-team-0123456789")
        # Signed as a run signs it: its path below the checkpoint root, the root's name (the run id) first.
        storage.upload(state, f"{root}/m1/step-000002.tar.gz", {}, "a signed state",
                       signed_as=f"{root.rsplit('/', 1)[-1]}/m1/step-000002.tar.gz")
        [artifact] = discover(root, require_commit=True)
        assert artifact.committed and Md5Store.reads == []
        monkeypatch.setenv(SIGNING_KEY_ENV, "another-key-0123456789abcdef")  # the listing cannot vouch: read
        [artifact] = discover(root, require_commit=True)
        assert not artifact.committed and "signed with another key" in artifact.reason  # and then not taken
        assert len(Md5Store.reads) == 1
    finally:
        fsspec.filesystem("md5sig").rm(root, recursive=True)
