"""Find and classify the checkpoint artifacts a training run left under a root URL.

Everything goes through fsspec, so a local path, `memory://`, `s3://` or any
other protocol works the same. The root is listed exactly once (one recursive
`find`). A checkpoint txflow committed carries a commit marker that records
every file with its size and MD5 (`markers.commit_record`). Where the store lists MD5
ETags (S3 and its clones, single-part uploads, which is how txflow uploads), the
listing alone proves a committed checkpoint holds exactly the committed bytes:
each file's ETag is its MD5, and the marker's own ETag must be the MD5 of the
record those give. So a committed checkpoint costs no request beyond the
listing, its tarballs included. Only where that does not hold (a store without
MD5 ETags such as a local disk, a damaged checkpoint, an old marker) is the
marker read, and each file's digest compared with the ETag or, without one,
computed from the file. Where the commit found the store's ETags are not MD5s
(multipart uploads, SSE-KMS or SSE-C buckets), its marker says so
(`verify: read`) and the files are always read. A tarball nobody committed is
read to its end. An artifact with a `.txflow-pruning` sidecar is being deleted
(`txflow.checkpoints.retention`) and reads incomplete, whatever is left of it.

What SkyRL-tx leaves under its checkpoints base:

- `save_state(name)`: a DIRECTORY `<model_id>/<name>.tar.gz/` (the suffix lies).
  With txflow's engine (see `txflow.upstream.skyrl_tx.checkpoint_io`, the `rank0-checkpoint-io` change) it holds one
  file, `txflow-state.msgpack`; upstream's own engine writes a Flax/Orbax checkpoint step `checkpoint_0/` there instead.
  Both are recognised.
- `save_weights_for_sampler(name)`: a real gzip tarball FILE
  `<model_id>/sampler_weights/<name>.tar.gz` plus a `<name>.tar.gz.probe` marker.
"""

from __future__ import annotations

import gzip
import json
import posixpath
import re
import tarfile
import time
import zlib
from typing import Literal

import fsspec
from pydantic import BaseModel

from txflow.checkpoints.lease import LEASE
from txflow.checkpoints.markers import (
    BEING_PRUNED,
    COMMIT_SUFFIX,
    PRUNED_SUFFIX,
    PRUNING_SUFFIX,
    VERIFY_ETAG,
    begun_prune,
    check_signature,
    commit_record,
    listed_size,
    md5_etag,
    md5_of,
    read_commit,
    relpath,
    same_path,
    signing_key,
    verify_method,
)
from txflow.log import get_logger
from txflow.upstream.skyrl_tx.layout import STATE_FILE

MANIFEST_NAME = "manifest.json"
TARBALL_SUFFIXES = (".tar.gz", ".tgz", ".tar")
PROBE_SUFFIX = ".probe"
SAMPLER_DIR = "sampler_weights"

# Files whose presence makes a directory an Orbax checkpoint step.
ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "commit_success.txt")
ORBAX_PROCESS_DIR = re.compile(r"ocdbt\.process_.*")

# Completeness rule, from a real checkpoint written with orbax-checkpoint 0.12.8
# through `flax.training.checkpoints.save_checkpoint_multiprocess(step=0,
# prefix="checkpoint_")` on a local filesystem. The step dir then holds:
#   checkpoint_0/_CHECKPOINT_METADATA   step metadata (written first, commit time added at the end)
#   checkpoint_0/_METADATA              pytree metadata, needed to restore
#   checkpoint_0/_sharding, manifest.ocdbt, d/<hash>, array_metadatas/process_0,
#   checkpoint_0/ocdbt.process_0/manifest.ocdbt, ocdbt.process_0/d/<hash>...
#   checkpoint_0/commit_success.txt     "Checkpoint commit was successful to <path>"
# Orbax writes everything into `checkpoint_0.orbax-checkpoint-tmp/`, writes
# commit_success.txt there LAST and then renames the dir to `checkpoint_0`.
# So on a local filesystem the rename is the real "finished" marker (a save
# interrupted before the rename leaves a tmp dir that already holds
# commit_success.txt), while on object stores, where Orbax cannot rename and
# writes in place, commit_success.txt is the marker. A step is complete iff
# its name has no tmp suffix AND it holds both metadata files AND commit_success.txt.
ORBAX_REQUIRED = ("_CHECKPOINT_METADATA", "_METADATA")
ORBAX_FINISHED = "commit_success.txt"
ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"
# A step dir named like this is one step of a checkpoint dir: the artifact is its parent.
STEP_NAME = re.compile(r"(checkpoint_)?\d+(" + re.escape(ORBAX_TMP_SUFFIX) + r".*)?")


class Artifact(BaseModel):
    """One thing a run left under the root: a training state, a sampler tarball, an exported model (a PEFT
    adapter or a merged model, see `export`) or a plain file."""

    kind: Literal["state", "sampler", "export", "file"]
    format: Literal["directory", "tarball", "file"]
    url: str
    path: str
    bytes: int
    files: int | None  # for a tarball its members; None when it was not read (a committed one)
    complete: bool
    reason: str | None = None
    committed: bool = False


def discover(
    root: str,
    storage_options: dict | None = None,
    *,
    require_commit: bool = False,
    verify_tarballs: bool = True,
) -> list[Artifact]:
    """List and classify every artifact under `root`, sorted by path.

    Orbax checkpoint directories come back as one `state` artifact each,
    tarballs under a `sampler_weights/` dir as `sampler`, exported models
    (a directory holding `adapter_config.json`, or `config.json` and safetensors
    weights) as `export`, anything else as `file`. `.probe` markers and commit sidecars are not reported. With
    `require_commit`, a state or sampler artifact without a commit sidecar is
    incomplete. Raises FileNotFoundError when nothing is found under `root`.
    """
    fs, root_path = fsspec.core.url_to_fs(root, **(storage_options or {}))
    files, fs_paths, etags = _list_files(fs, root_path)
    if not files:
        raise FileNotFoundError(f"Nothing was found under {root!r}: the root does not exist or holds no files.")

    children = _children(files)
    artifact_dirs, steps = _orbax_layout(children)
    exports = [d for d in _export_dirs(children) if _ancestor_in(d, set(artifact_dirs)) is None]
    artifact_dirs = sorted(artifact_dirs + exports)
    # Each file's owning artifact dir in one pass over parents (not files x dirs: 10,000 x 200 is seconds).
    members: dict[str, dict[str, int]] = {d: {} for d in artifact_dirs}
    loose = []
    for rel, size in files.items():
        owner = _ancestor_in(rel, members)
        if owner is None:
            loose.append(rel)
        else:
            members[owner][relpath(rel, owner)] = size
    artifacts = [_export_artifact(root, d, members[d]) if d in exports
                 else _state_artifact(root, d, steps[d], members[d], children) for d in artifact_dirs]
    for rel in loose:
        if _is_auxiliary(rel, files) or rel == MANIFEST_NAME:  # the listing itself is not listed
            continue
        if rel.endswith(TARBALL_SUFFIXES):
            artifacts.append(_tarball_artifact(root, rel, files[rel]))
        else:
            artifacts.append(_artifact(root, rel, "file", "file", files[rel], 1))

    checked = [a for a in artifacts if a.kind != "file"]
    actual = {a.path: _artifact_files(a, files, members) for a in checked}
    key = signing_key()
    # A run's markers are signed for `<run id>/<path below the run root>`: the root's last name, when it is a
    # run root (any other root's markers are read, not matched from the listing).
    signed_prefix = posixpath.basename(root_path.rstrip("/"))
    unverified = {a.path for a in checked
                  if not _commit_matches_listing(a, actual[a.path], etags, key, f"{signed_prefix}/{a.path}")}
    # The sidecars the listing could not verify, in one batched read (concurrent on object stores).
    sidecars = [fs_paths[p + COMMIT_SUFFIX] for p in sorted(unverified) if p + COMMIT_SUFFIX in files]
    contents = fs.cat(sidecars, on_error="return") if sidecars else {}
    for artifact in checked:
        if artifact.path in unverified:
            _check_commit(fs, artifact, actual[artifact.path], files, fs_paths, etags, contents, require_commit, key)
        else:
            artifact.committed = True
    for artifact in artifacts:
        if _being_pruned(fs, artifact, files, fs_paths, key):  # whatever is left of it, it is going
            artifact.complete, artifact.committed, artifact.reason = False, False, BEING_PRUNED
        # A committed tarball holds the bytes that were read to their end before the commit; others are read.
        elif artifact.format == "tarball" and not artifact.committed and artifact.complete and verify_tarballs:
            _verify_tarball(fs, artifact, fs_paths[artifact.path])
    return sorted(artifacts, key=lambda a: a.path)


def write_manifest(root: str, artifacts: list[Artifact], storage_options: dict | None = None) -> str:
    """Write `<root>/manifest.json` describing `artifacts` and return its URL.

    Call it after `discover`, which never lists the root's own manifest.json.
    """
    fs, root_path = fsspec.core.url_to_fs(root, **(storage_options or {}))
    listed = [a.model_dump() for a in artifacts]
    manifest = {"root": root, "artifacts": listed, "generated_at": time.time()}
    fs.pipe_file(_join(root_path, MANIFEST_NAME), json.dumps(manifest, indent=1).encode())
    return _url(root, MANIFEST_NAME)


# --- listing ---------------------------------------------------------------


def _list_files(
    fs: fsspec.AbstractFileSystem, root_path: str
) -> tuple[dict[str, int], dict[str, str], dict[str, str]]:
    """The one recursive listing: {relative path: size}, {relative path: fs path} and {relative path:
    MD5 ETag, where the store lists one} of every file.

    Directories are not asked for: S3 has none, and other filesystems differ
    on whether find() reports them, so `_children` derives them from file paths.
    """
    root_path = root_path.rstrip("/")
    sizes: dict[str, int] = {}
    fs_paths: dict[str, str] = {}
    etags: dict[str, str] = {}
    for path, info in fs.find(root_path, detail=True).items():
        if info.get("type", "file") != "file":
            continue
        if same_path(path, root_path):
            raise NotADirectoryError(f"{root_path!r} is a file; discover() expects the directory of a run.")
        rel = relpath(path, root_path)
        sizes[rel] = listed_size(info)
        fs_paths[rel] = path
        etag = md5_etag(info)
        if etag:
            etags[rel] = etag
    return sizes, fs_paths, etags


def _children(files: dict[str, int]) -> dict[str, set[str]]:
    """{directory: names of its direct children (files and dirs)}, "" being the root."""
    children: dict[str, set[str]] = {}
    for rel in files:
        parent, name = posixpath.split(rel)
        while True:
            children.setdefault(parent, set()).add(name)
            if not parent:
                break
            parent, name = posixpath.split(parent)
    return children


# --- Orbax checkpoints -----------------------------------------------------


def _orbax_layout(children: dict[str, set[str]]) -> tuple[list[str], dict[str, list[str]]]:
    """Find the state artifact dirs and, for each Orbax one, the step dirs it holds."""
    txflow_states = [d for d, names in children.items() if STATE_FILE in names or _partial(STATE_FILE) in names]
    candidates = [d for d, names in children.items() if d not in txflow_states and _looks_like_step(names)]
    # An Orbax step holds nested dirs that look like steps too (ocdbt.process_0
    # has its own manifest.ocdbt): keep only the outermost.
    step_dirs = _outermost(candidates)
    artifact_dirs = _outermost([_artifact_dir(d) for d in step_dirs] + txflow_states)
    steps = {a: [s for s in step_dirs if _inside(s, a)] for a in artifact_dirs}
    return artifact_dirs, steps


def _partial(name: str) -> str:
    return name + ".partial"


def _looks_like_step(names: set[str]) -> bool:
    return any(m in names for m in ORBAX_MARKERS) or any(ORBAX_PROCESS_DIR.fullmatch(n) for n in names)


def _artifact_dir(step_dir: str) -> str:
    parent, name = posixpath.split(step_dir)
    return parent if step_dir and STEP_NAME.fullmatch(name) else step_dir


def _state_artifact(
    root: str, adir: str, step_dirs: list[str], members: dict[str, int], children: dict[str, set[str]]
) -> Artifact:
    problems = [p for step in step_dirs if (p := _step_problem(step, children[step]))]
    if not step_dirs and STATE_FILE not in members:
        problems.append(f"{STATE_FILE!r} is missing (only its partial write is there): the save did not finish; "
                        "save the state again.")
    artifact = _artifact(root, adir, "state", "directory", sum(members.values()), len(members))
    return _fail(artifact, " ".join(problems)) if problems else artifact


def _step_problem(step_dir: str, names: set[str]) -> str | None:
    """Why an Orbax step dir is not a finished checkpoint, or None when it is."""
    if ORBAX_TMP_SUFFIX in posixpath.basename(step_dir):
        return (
            f"Orbax checkpoint {step_dir!r} is still a temporary directory: the save was interrupted "
            "before Orbax renamed it into place; save the state again."
        )
    missing = [n for n in (*ORBAX_REQUIRED, ORBAX_FINISHED) if n not in names]
    if missing:
        return (
            f"Orbax checkpoint {step_dir!r} is missing {', '.join(missing)} "
            f"({ORBAX_FINISHED} is Orbax's finished marker): the save did not finish; save the state again."
        )
    return None


# --- exported models -------------------------------------------------------------

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
HF_CONFIG = "config.json"


def _export_dirs(children: dict[str, set[str]]) -> list[str]:
    """Directories holding a PEFT adapter (its config) or a Hugging Face model (config and safetensors)."""
    return _outermost([d for d, names in children.items() if d and (
        PEFT_FILES[0] in names or (HF_CONFIG in names and any(n.endswith(".safetensors") for n in names)))])


def _export_artifact(root: str, adir: str, members: dict[str, int]) -> Artifact:
    artifact = _artifact(root, adir, "export", "directory", sum(members.values()), len(members))
    if PEFT_FILES[0] in members and PEFT_FILES[1] not in members:
        _fail(artifact, f"{PEFT_FILES[1]!r} is missing: the export did not finish; export again.")
    return artifact


# --- tarballs ----------------------------------------------------------------


def _tarball_artifact(root: str, rel: str, size: int) -> Artifact:
    kind = "sampler" if posixpath.basename(posixpath.dirname(rel)) == SAMPLER_DIR else "file"
    return _artifact(root, rel, kind, "tarball", size, None)  # members unknown until it is read


def _verify_tarball(fs: fsspec.AbstractFileSystem, artifact: Artifact, fs_path: str) -> None:
    """Read the tarball to its end: count its members, or mark it incomplete when it is cut or corrupt."""
    try:
        artifact.files = count_tar_members(fs, fs_path)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        _fail(artifact, f"Tarball {artifact.path!r} is truncated or corrupt ({type(exc).__name__}: {exc}); "
                        "write it again.")


class _CountingReader:
    """Wraps a readable file to count the bytes read through it (tarfile's stream mode only calls read)."""

    def __init__(self, f):
        self.f, self.count = f, 0

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.count += len(data)
        return data


def count_tar_members(fs: fsspec.AbstractFileSystem, fs_path: str) -> int:
    """Stream the whole tarball and return its member count; raise if it is truncated or corrupt.

    tarfile's "r|*" alone misses truncations, as observed with Python 3.11: it
    never checks the gzip trailer (CRC, length) and stops silently at EOF
    when the data ends on a member boundary. So gzip is decoded with
    `gzip.GzipFile`, which checks the trailer at EOF, and the tar must end
    with its end-of-archive marker (two zero blocks).
    """
    with fs.open(fs_path, "rb") as raw:
        compressed = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        stream = _CountingReader(gzip.GzipFile(fileobj=raw, mode="rb") if compressed else raw)
        members = 0
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for _ in tar:  # stream mode reads (does not seek) past each member's data
                members += 1
            end_of_members = tar.offset
            while stream.read(1 << 20):  # drain to EOF so GzipFile checks the trailer
                pass
    if stream.count < end_of_members + 2 * tarfile.BLOCKSIZE:
        raise EOFError("the end-of-archive marker is missing after the last member")
    return members


# --- auxiliary files and commit sidecars ---------------------------------------


def _is_auxiliary(rel: str, files: dict[str, int]) -> bool:
    """Commit and prune sidecars, a running run's lease, and `.probe` markers next to a tarball, are not
    artifacts."""
    if rel.endswith((COMMIT_SUFFIX, PRUNING_SUFFIX, PRUNED_SUFFIX)) or rel.rsplit("/", 1)[-1] == LEASE:
        return True
    stem = rel.removesuffix(PROBE_SUFFIX)
    return rel.endswith(PROBE_SUFFIX) and stem in files and stem.endswith(TARBALL_SUFFIXES)


def _being_pruned(fs, artifact: Artifact, files: dict[str, int], fs_paths: dict[str, str], key: bytes | None) -> bool:
    """Whether a deletion txflow began is under way on `artifact` (its `.txflow-pruning` record, `begun_prune`);
    any other file of that name is named in a warning and changes nothing."""
    sidecar = artifact.path + PRUNING_SUFFIX
    if sidecar not in files:
        return False
    begun, why = begun_prune(fs, fs_paths[sidecar].removesuffix(PRUNING_SUFFIX), key)
    if begun is None:
        get_logger().warning(f"discover: {why}")
    return begun is not None


def _commit_matches_listing(artifact: Artifact, actual: dict[str, int], etags: dict[str, str],
                            key: bytes | None, signed_as: str) -> bool:
    """True when the sidecar's listed ETag is the MD5 of the record of exactly the files listed now, each
    with its listed MD5 ETag (signed with `key`, when there is one): the stored bytes are the committed
    ones, and nothing was read to know it."""
    etag = etags.get(artifact.path + COMMIT_SUFFIX)
    if etag is None:
        return False
    listed = {}
    for name, size in actual.items():
        file_etag = etags.get(_member_path(artifact, name))
        if file_etag is None:
            return False
        listed[name] = (size, file_etag)
    return md5_of(commit_record(listed, path=signed_as, key=key)) == etag


def _check_commit(
    fs: fsspec.AbstractFileSystem,
    artifact: Artifact,
    actual: dict[str, int],
    files: dict[str, int],
    fs_paths: dict[str, str],
    etags: dict[str, str],
    contents: dict,
    require_commit: bool,
    key: bytes | None = None,
) -> None:
    """Set `committed` when the artifact's sidecar matches what is on storage, else explain why not."""
    sidecar = artifact.path + COMMIT_SUFFIX
    if sidecar not in files:
        if require_commit:
            _fail(artifact, f"There is no commit marker {posixpath.basename(sidecar)!r}: the save did not finish.")
        return
    try:
        content = contents.get(fs_paths[sidecar])
        if content is None or isinstance(content, Exception):
            raise ValueError(str(content))
        recorded = read_commit(content)
        trust_etags = verify_method(content) == VERIFY_ETAG
    except (ValueError, KeyError, TypeError) as exc:
        _fail(artifact, f"The commit marker {sidecar!r} is unreadable ({exc}); the save did not finish.")
        return
    try:  # with a signing key, a marker not signed with it for this path is no commit (nothing reads it)
        check_signature(content, fs_paths[sidecar].removesuffix(COMMIT_SUFFIX), key, artifact.path)
    except ValueError as exc:
        artifact.reason = f"{artifact.reason} {exc}" if artifact.reason else str(exc)
        if require_commit:
            artifact.complete = False
        return
    unrecorded = sorted(set(actual) - set(recorded))
    if unrecorded:
        _fail(artifact, f"{unrecorded[0]!r} is not recorded in the commit marker: a file was added after the "
                        "commit, so the stored checkpoint is not the committed one.")
        return
    for name, (size, md5) in recorded.items():
        if name not in actual:
            _fail(artifact, f"{name!r} is recorded in the commit marker but missing: the artifact was damaged.")
            return
        if actual[name] != size:
            _fail(artifact, f"{name!r} has {actual[name]} bytes, the commit marker recorded {size}.")
            return
        if md5 is None:
            continue  # a sizes-only marker (format 1)
        member = _member_path(artifact, name)
        found = etags.get(member) if trust_etags else None
        if found is None:  # no ETag, or one the commit found is no MD5 (multipart, SSE-KMS): read the bytes
            with fs.open(fs_paths[member], "rb") as f:
                found = md5_of(f)
        if found != md5:
            _fail(artifact, f"{name!r} has MD5 {found}, the commit marker recorded {md5}: the stored copy is not "
                            "the committed one (changed or damaged after the commit).")
            return
    artifact.committed = True


def _member_path(artifact: Artifact, name: str) -> str:
    """The root-relative path of file `name` of the artifact (as keyed in its sidecar)."""
    return f"{artifact.path}/{name}" if artifact.format == "directory" else artifact.path


def _artifact_files(artifact: Artifact, files: dict[str, int], members: dict[str, dict[str, int]]) -> dict[str, int]:
    """{name: size} keyed like `write_commit` keys the sidecar: relative to a dir, the basename for a file."""
    if artifact.format == "directory":
        return members[artifact.path]
    return {posixpath.basename(artifact.path): files[artifact.path]}


# --- small helpers -------------------------------------------------------------


def _artifact(root: str, rel: str, kind: str, fmt: str, size: int, count: int | None) -> Artifact:
    return Artifact(kind=kind, format=fmt, url=_url(root, rel), path=rel, bytes=size, files=count, complete=True)


def _fail(artifact: Artifact, reason: str) -> Artifact:
    """Mark incomplete, keeping earlier reasons: each one is something to fix."""
    artifact.complete = False
    artifact.reason = f"{artifact.reason} {reason}" if artifact.reason else reason
    return artifact


def _url(root: str, rel: str) -> str:
    """Root as given plus the relative path, so the protocol prefix is kept."""
    if not rel:
        return root
    return root + rel if root.endswith("/") else f"{root}/{rel}"


def _join(base: str, rel: str) -> str:
    return f"{base.rstrip('/')}/{rel}" if base.rstrip("/") else rel


def _inside(rel: str, directory: str) -> bool:
    return not directory or rel == directory or rel.startswith(directory + "/")


def _ancestor_in(rel: str, directories) -> str | None:
    """The outermost of `directories` (a set or dict) that holds `rel` or is `rel`, else None."""
    found = rel if rel in directories else None
    while rel:
        rel = posixpath.dirname(rel)
        if rel in directories:
            found = rel
    return found


def _outermost(dirs: list[str]) -> list[str]:
    """The dirs not nested inside another one of `dirs`, sorted."""
    unique = set(dirs)
    return sorted(d for d in unique if _ancestor_in(d, unique) == d)
