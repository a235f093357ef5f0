"""Durable checkpoints on any fsspec URL.

SkyRL-tx writes checkpoints through cloudpathlib; on S3 the training state
(an Orbax directory) stays in a process-local cache and never reaches the
bucket, and with several processes the save hangs (see the upstream notes).
So the engine always writes to a LOCAL staging directory, and txflow makes
each checkpoint durable itself:

- commit: upload staging/<relative> to <run_root>/<relative> with fsspec,
  check that every file arrived with its size, then write the commit marker
  last. A checkpoint without its marker is incomplete, whatever else exists.
- import: download a committed checkpoint from the run root into staging
  under a fresh model's id and register it with the engine, so restores and
  resumes read the durable copy, on a fresh cluster as well.

The same path serves local roots (a copy) and object stores, so every local end-to-end test exercises it. Staging is on
the coordinator node only: the engine's checkpoint I/O runs on rank 0 (`txflow.upstream.skyrl_tx.checkpoint_io`, the
`rank0-checkpoint-io` change), so no other rank's disk holds a checkpoint file and no filesystem is shared between
ranks.
"""

from __future__ import annotations

import posixpath
import shutil
import time
from pathlib import Path

import fsspec

from txflow.checkpoints import lease
from txflow.checkpoints.discovery import Artifact, count_tar_members, discover
from txflow.checkpoints.markers import (
    BEING_PRUNED,
    COMMIT_SUFFIX,
    check_signature,
    md5_of,
    read_commit,
    signing_key,
    write_commit,
)
from txflow.checkpoints.names import step_of
from txflow.checkpoints.retention import pruned_record
from txflow.config import RunConfig
from txflow.upstream.skyrl_tx import layout


def engine_checkpoints_base(cfg: RunConfig) -> str:
    """The engine's local staging directory; durable copies go to the run root."""
    return str(Path(cfg.state_dir) / "checkpoints")


def fresh_staging(cfg: RunConfig) -> str:
    """The staging directory, emptied for a new cluster. What an earlier attempt left there is either
    committed already or the unfinished work of a cluster that failed (a custom client runs again from
    the start), which must never be committed as this attempt's."""
    staging = Path(engine_checkpoints_base(cfg))
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return str(staging)


def checkpoint_url(cfg: RunConfig, tinker_path: str) -> str:
    """Durable URL of the checkpoint the engine saved as `tinker_path`."""
    return f"{cfg.run_root}/{layout.relative_checkpoint_path(tinker_path)}"


def tinker_path_of(cfg: RunConfig, url: str) -> str:
    """The tinker:// path under which the engine saved the checkpoint now at `url` in this run's root."""
    relative = url.removeprefix(cfg.run_root).strip("/")
    path = layout.tinker_path_for(relative)
    if path is None:
        raise ValueError(f"{url} is not a checkpoint of run {cfg.run_id} under {cfg.run_root}")
    return path


# One PUT per file up to S3's single-part limit: the object's ETag is then its MD5, which is what
# lets discovery verify a committed checkpoint from the listing alone.
SINGLE_PART_BYTES = 5 * 2**30 - 1


def commit(cfg: RunConfig, staging_base: str, tinker_path: str) -> str:
    """Upload one checkpoint from staging to the run root, verify it, write its marker; returns its URL.

    A sampler tarball is read to its end here first, so a committed tarball never needs reading again.
    """
    lease.check(cfg.run_root, cfg.plain_storage_options())  # never commit under another run's lease
    relative = layout.relative_checkpoint_path(tinker_path)
    local = Path(staging_base) / relative
    if local.is_file():
        _check_local_tarball(local, tinker_path)
    elif not local.is_dir():
        raise FileNotFoundError(f"The engine reported {tinker_path} but nothing is at {local}")
    return upload(local, f"{cfg.run_root}/{relative}", cfg.plain_storage_options(), tinker_path,
                  signed_as=f"{cfg.run_id}/{relative}")


def upload(local: Path, url: str, options: dict, what: str, signed_as: str | None = None) -> str:
    """Upload a local file, or a directory with everything in it, to `url`, verify that every file arrived,
    and write the commit marker last; returns `url`. The marker records each file's size and MD5, taken
    from the local copy; with a signing key it is signed for `signed_as`, the path of `url` below its
    checkpoint root (`<run id>/...`, so that the root can move), else for the whole path of `url`."""
    if local.is_dir():
        paths = {p.relative_to(local).as_posix(): p for p in sorted(local.rglob("*")) if p.is_file()}
    else:
        paths = {url.rstrip("/").rsplit("/", 1)[-1]: local}  # a file is recorded under its stored name
    files = {}
    for name, path in paths.items():
        with open(path, "rb") as f:
            files[name] = (path.stat().st_size, md5_of(f))
    fs, remote = fsspec.core.url_to_fs(url, **options)
    targets = [f"{remote}/{n}" for n in files] if local.is_dir() else [remote]
    for parent in sorted({t.rsplit("/", 1)[0] for t in targets}):
        fs.makedirs(parent, exist_ok=True)  # local filesystems need parents; object stores ignore this
    extra = {"chunksize": SINGLE_PART_BYTES} if "s3" in fs.protocol else {}
    try:
        fs.put([str(p) for p in paths.values()], targets, **extra)
        write_commit(url, options, expected=files, signed_as=signed_as)
    except Exception as exc:  # any storage error: say what it means for the checkpoint
        raise OSError(f"Committing {what} to {url} failed; no commit marker was written, so the "
                      f"checkpoint counts as incomplete ({type(exc).__name__}: {exc})") from exc
    return url


def _check_local_tarball(path: Path, tinker_path: str) -> None:
    try:
        count_tar_members(fsspec.filesystem("file"), str(path))
    except Exception as exc:
        raise OSError(f"The engine's {tinker_path} at {path} is not a complete tarball ({exc}); "
                      f"nothing was committed") from exc


def import_checkpoint(cfg: RunConfig, staging_base: str, url: str, kind: str, model_id: str, name: str) -> str:
    """Copy the checkpoint at `url` into staging as `name` of `model_id`, verify every file against its
    commit marker's MD5, and register it; returns its tinker path."""
    tinker_path = layout.tinker_path(model_id, kind, name)
    local = Path(staging_base) / layout.relative_checkpoint_path(tinker_path)
    download(url, local, cfg.plain_storage_options(), directory=kind == "state")
    layout.register_checkpoint(cfg.resolved_database_url(), model_id, name, kind)
    return tinker_path


def download(url: str, local: Path, options: dict, directory: bool) -> None:
    """Copy the committed checkpoint at `url` (a directory or one file) to `local`, replacing what is there:
    exactly the files its commit marker records, each written inside `local` and checked against the MD5
    the marker records. Raises ValueError, before anything is written, when the checkpoint holds a file its
    marker does not record (a bucket writer's addition), the marker records a name that is not a plain
    relative path, or, with a signing key, the marker is not signed with it."""
    fs, remote = fsspec.core.url_to_fs(url, **options)
    remote = remote.rstrip("/")
    name = posixpath.basename(remote)
    content = fs.cat_file(remote + COMMIT_SUFFIX)
    check_signature(content, remote, signing_key(), url)
    recorded = read_commit(content)  # every name a plain relative path
    if directory:
        unrecorded = sorted(set(_stored_names(fs, remote)) - set(recorded))
        if unrecorded:
            raise ValueError(f"{url}: {unrecorded[0]!r} is not recorded in its commit marker (added after the commit): "
                             f"the stored checkpoint is not the committed one; nothing was downloaded")
    elif set(recorded) != {name}:
        raise ValueError(f"{url}: its commit marker records {sorted(recorded)[:3]}, not this one file: the stored "
                         f"checkpoint is not the committed one; nothing was downloaded")
    if local.exists():
        shutil.rmtree(local) if local.is_dir() else local.unlink()
    (local if directory else local.parent).mkdir(parents=True, exist_ok=True)
    for file_name, (size, md5) in recorded.items():
        copy = _inside(local, file_name) if directory else local
        fs.get_file(f"{remote}/{file_name}" if directory else remote, str(copy))
        with open(copy, "rb") as f:
            found = md5_of(f)
        if (md5 is None and copy.stat().st_size != size) or (md5 is not None and found != md5):
            raise ValueError(f"{url}: {file_name} downloaded with MD5 {found}, its commit marker recorded "
                             f"{md5 or f'{size} bytes'}: the stored checkpoint is not the committed one")


def _stored_names(fs, remote: str) -> list[str]:
    """Every file under the directory `remote`, by its path below it, exactly as stored (an object store
    keeps `..` and empty segments in a key)."""
    prefix = remote.lstrip("/") + "/"
    return [path.lstrip("/")[len(prefix):] for path in fs.find(remote)]


def _inside(local: Path, name: str) -> Path:
    """Where the file `name` of a directory checkpoint goes under `local`: never outside it, never through a
    symlink."""
    copy = local.joinpath(*name.split("/"))
    copy.parent.mkdir(parents=True, exist_ok=True)
    if copy.is_symlink() or not copy.parent.resolve().is_relative_to(local.resolve()):
        raise ValueError(f"{name!r} would be written outside {local}; nothing of it was downloaded")
    return copy


def latest_state(root: str, storage_options: dict | None = None) -> Artifact | None:
    """The committed, complete state checkpoint with the highest step under `root`, if any."""
    try:
        artifacts = discover(root, storage_options)
    except FileNotFoundError:
        return None
    states = [a for a in artifacts if a.kind == "state" and a.complete and a.committed and step_of(a.path) is not None]
    return max(states, key=lambda a: step_of(a.path), default=None)


def remove_ephemeral_samplers(checkpoints_base: str, model_id: str | None = None) -> list[str]:
    """Delete the transient sampler weights SkyRL-tx wrote for sampling clients (of `model_id` only, when
    given: on a shared cluster the others are other runs'); returns what went."""
    base = Path(checkpoints_base)
    removed = []
    for path in base.glob(f"{model_id or '*'}/sampler_weights/*"):
        relative = path.relative_to(base).as_posix()
        if layout.is_ephemeral_sampler(relative):
            path.unlink(missing_ok=True)
            removed.append(relative)
    return removed


def resolve_resume_from(cfg: RunConfig) -> tuple[str, int]:
    """(URL, step) for `--resume-from`: a run root (its latest committed state), the URL of one state
    checkpoint, or a tinker:// path of this run. Raises ValueError when it is not a usable state."""
    source = cfg.resume_from
    options = cfg.plain_storage_options()
    url = checkpoint_url(cfg, source) if source.startswith("tinker://") else source.rstrip("/")
    if url.endswith(".tar.gz"):
        parent = url.rsplit("/", 1)[0]
        try:
            found = next((a for a in discover(parent, options) if a.url.rstrip("/") == url), None)
        except FileNotFoundError:
            found = None
        if found is None or found.kind != "state" or found.reason == BEING_PRUNED:
            raise ValueError(f"--resume-from {source}: {_gone(url, found, options)}")
        if not (found.complete and found.committed) or step_of(url) is None:
            raise ValueError(f"--resume-from {source}: the checkpoint at {url} is incomplete "
                             f"({found.reason or 'no step in its name'}); pass its run root to use the latest "
                             f"complete one")
    else:
        latest = latest_state(url, options)
        if latest is None:
            raise ValueError(f"--resume-from {source}: no complete, committed state checkpoint under {url}")
        url = latest.url
    check_signed(url, options)
    return url, step_of(url)


def check_signed(url: str, options: dict) -> None:
    """With a signing key, raise ValueError unless the commit marker of the checkpoint at `url` is signed with
    it (`download` checks again; this says so before anything starts)."""
    key = signing_key()
    if key is None:
        return
    fs, remote = fsspec.core.url_to_fs(url, **options)
    remote = remote.rstrip("/")
    try:
        content = fs.cat_file(remote + COMMIT_SUFFIX)
    except FileNotFoundError:
        raise ValueError(f"{url}: it has no commit marker") from None
    check_signature(content, remote, key, url)


def _gone(url: str, found: Artifact | None, options: dict) -> str:
    """Why there is no state to resume from at `url`, and the newest one still in its run root."""
    record = pruned_record(url, options)
    if found is not None and found.reason == BEING_PRUNED:
        what = f"the checkpoint at {url} is being pruned"
    elif record is not None:
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(record["pruned_at"]))
        what = f"the checkpoint at {url} was pruned on {when} ({record['reason']})"
    else:
        what = f"no state checkpoint at {url}"
    run_root = url.rsplit("/", 2)[0]  # <run_root>/<model id>/<name>
    newest = latest_state(run_root, options)
    if newest is None:
        return f"{what}, and its run root {run_root} holds no complete state"
    return f"{what}; the newest state still there is {newest.url} (step {step_of(newest.path)})"
