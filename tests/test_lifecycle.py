"""Promotion, retention and leases on a local disk (the same code serves object stores: test_lifecycle_e2e)."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest

from tests.helpers import fresh_root, lease_race, taken_over_while_held
from txflow import cli
from txflow.artifacts import promote
from txflow.checkpoints import lease, promotion, retention, storage
from txflow.checkpoints.discovery import discover
from txflow.checkpoints.markers import (
    BEING_PRUNED,
    COMMIT_SUFFIX,
    PRUNED_SUFFIX,
    PRUNING_SUFFIX,
    commit_record,
    md5_of,
    pruning_record,
)
from txflow.config import RunConfig
from txflow.reporting.report import lifecycle_markdown
from txflow.upstream.skyrl_tx.layout import STATE_FILE


def committed_state(run_root: Path, step: int, size: int = 1000) -> str:
    """A committed state checkpoint of txflow's naming at `step`, as a run leaves it."""
    local = run_root.parent.with_name(run_root.parent.name + "-staging") / run_root.name / f"step-{step:06d}"
    local.mkdir(parents=True)
    (local / STATE_FILE).write_bytes(os.urandom(size))
    return storage.upload(local, str(run_root / "m1" / f"step-{step:06d}.tar.gz"), {}, f"step {step}")


def passed_run(root: Path, run_id: str, steps: tuple[int, ...]) -> dict[int, str]:
    urls = {step: committed_state(root / run_id, step) for step in steps}
    (root / run_id / "report.json").write_text(json.dumps({"status": "passed"}))
    return urls


def states(run_root: Path) -> dict[int, bool]:
    """{step: complete and committed} of the state checkpoints discovery finds."""
    return {storage.step_of(a.path): a.complete and a.committed for a in discover(str(run_root)) if a.kind == "state"}


# --- retention ------------------------------------------------------------------------------------------


def test_keep_last_keeps_the_final_state_and_the_newest_periodic_ones(tmp_path):
    urls = passed_run(tmp_path, "r", (2, 4, 6, 8, 10))
    deletions = retention.apply(str(tmp_path / "r"), discover(str(tmp_path / "r")), keep_last=1)
    assert sorted(d.step for d in deletions) == [2, 4, 6]
    assert states(tmp_path / "r") == {8: True, 10: True}
    assert sum(d.bytes for d in deletions) == 3 * 1000
    # Each one that went says when and why, where it was.
    record = retention.pruned_record(urls[2])
    assert record["bytes"] == 1000 and "beyond the newest 1 periodic states" in record["reason"]


def test_what_retention_never_deletes(tmp_path):
    """The final state, a protected (promoted-from) state, a custom client's states, and states of steps
    younger than --older-than."""
    urls = passed_run(tmp_path, "r", (2, 4, 6))
    client = tmp_path / "elsewhere" / "mine"
    client.mkdir(parents=True)
    (client / STATE_FILE).write_bytes(b"x" * 10)
    storage.upload(client, str(tmp_path / "r" / "m1" / "client-state"), {}, "a client's state")
    artifacts = discover(str(tmp_path / "r"))
    assert retention.plan(artifacts, keep_last=None, protected={urls[2]}) == [
        retention.Deletion(url=urls[4], step=4, bytes=1000, reason="")]
    ages = {urls[2]: 10 * 86400, urls[4]: 1 * 86400}
    assert [d.step for d in retention.plan(artifacts, None, older_than_s=5 * 86400, ages=ages)] == [2]
    assert [d.step for d in retention.plan(artifacts, 2, older_than_s=5 * 86400, ages=ages)] == []  # kept: newest 2
    assert [d.step for d in retention.plan(artifacts, 1, older_than_s=20 * 86400, ages=ages)] == []  # too young


def test_a_deletion_stopped_half_way_reads_incomplete_and_the_next_prune_finishes_it(tmp_path, monkeypatch):
    urls = passed_run(tmp_path, "r", (2, 4, 6))
    real_rm = fsspec.implementations.local.LocalFileSystem.rm

    def killed_before_the_data(self, path, recursive=False, maxdepth=None):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "rm", killed_before_the_data)
    with pytest.raises(KeyboardInterrupt):
        retention.prune(str(tmp_path), keep_last=1, older_than_days=None)
    monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "rm", real_rm)
    # The marker went first: the data is all there, and nothing takes it for a checkpoint.
    assert not os.path.exists(urls[2] + COMMIT_SUFFIX) and os.path.exists(f"{urls[2]}/{STATE_FILE}")
    [found] = [a for a in discover(str(tmp_path / "r")) if storage.step_of(a.path) == 2]
    assert not found.complete and found.reason == BEING_PRUNED
    cfg = RunConfig(run_id="again", checkpoints=str(tmp_path / "other"), resume_from=urls[2]).resolved()
    with pytest.raises(ValueError,
                       match=r"is being pruned; the newest state still there is .*step-000006.* \(step 6\)"):
        storage.resolve_resume_from(cfg)

    [run] = retention.prune(str(tmp_path), keep_last=1, older_than_days=None)
    assert [(d.step, d.reason) for d in run.deletions] == [(2, "a prune stopped half-way")]
    assert states(tmp_path / "r") == {4: True, 6: True}
    assert not os.path.exists(urls[2]) and not os.path.exists(urls[2] + PRUNING_SUFFIX)
    assert os.path.exists(urls[2] + PRUNED_SUFFIX)
    with pytest.raises(ValueError, match=r"was pruned on .*; the newest state still there is .* \(step 6\)"):
        storage.resolve_resume_from(cfg)


def test_a_deletion_stopped_after_the_data_is_finished_too(tmp_path):
    urls = passed_run(tmp_path, "r", (2, 4, 6))
    Path(urls[2] + PRUNING_SUFFIX).write_bytes(pruning_record(urls[2], 1000, "beyond the newest 1", None))
    Path(urls[2] + COMMIT_SUFFIX).unlink()
    storage.shutil.rmtree(urls[2])
    [run] = retention.prune(str(tmp_path), keep_last=5, older_than_days=None)
    assert [d.url for d in run.deletions] == [urls[2]]
    assert not os.path.exists(urls[2] + PRUNING_SUFFIX) and os.path.exists(urls[2] + PRUNED_SUFFIX)


@pytest.mark.parametrize("planted", ["m1", "m1/step-000004.tar.gz", "m1/step-000006.tar.gz"])
def test_a_planted_pruning_file_deletes_nothing(tmp_path, planted, caplog):
    """The attack: any `X.txflow-pruning` file was taken for an interrupted prune, and `prune
    --keep-last 5` deleted X, a whole model directory (final state included). Only a sidecar a deletion of
    exactly that state checkpoint wrote (its path and step) is finished; any other is named and left."""
    urls = passed_run(tmp_path, "r", (2, 4, 6))
    (tmp_path / "r" / (planted + PRUNING_SUFFIX)).write_text("{}")
    with caplog.at_level(logging.WARNING):
        assert {a.url: a.complete for a in discover(str(tmp_path / "r"))}[urls[4]]  # not "being pruned"
        [run] = retention.prune(str(tmp_path), keep_last=5, older_than_days=None)
    assert run.deletions == [] and states(tmp_path / "r") == {2: True, 4: True, 6: True}
    assert f"{planted}{PRUNING_SUFFIX} does not record a deletion of this state checkpoint" in caplog.text


def test_with_a_key_an_unsigned_higher_step_is_no_final_state_and_an_unsigned_pruning_file_deletes_nothing(
        tmp_path, monkeypatch, caplog):
    """With a signing key, retention and discovery take no unsigned marker: a forged higher step (its marker an
    MD5 list anyone can write) does not become the run's final state, and a well-formed but unsigned pruning
    record deletes nothing; discovery says why."""
    monkeypatch.setenv("TXFLOW_SIGNING_KEY", KEY)
    urls = passed_run(tmp_path, "r", (2, 4, 6))
    forged = tmp_path / "r" / "m1" / "step-000099.tar.gz"
    forged.mkdir()
    (forged / STATE_FILE).write_bytes(b"a writer's state")
    Path(str(forged) + COMMIT_SUFFIX).write_bytes(commit_record({STATE_FILE: (16, md5_of(b"a writer's state"))}))
    Path(urls[4] + PRUNING_SUFFIX).write_bytes(pruning_record(urls[4], 1000, "forged", None))  # unsigned
    with caplog.at_level(logging.WARNING):
        found = {a.url: a for a in discover(str(tmp_path / "r"), require_commit=True)}
        [run] = retention.prune(str(tmp_path), keep_last=1, older_than_days=None)
    assert not found[str(forged)].committed and "its commit marker is not signed" in found[str(forged)].reason
    assert found[urls[4]].committed and found[urls[4]].reason is None
    assert storage.latest_state(str(tmp_path / "r")).url == urls[6]
    assert [d.url for d in run.deletions] == [urls[2]]  # beyond the newest 1 before the final 6: step 2 only
    assert states(tmp_path / "r") == {4: True, 6: True, 99: False}  # 99 left as it is, never taken
    assert "step-000004.tar.gz.txflow-pruning: it is not signed" in caplog.text


def test_prune_leaves_running_and_failed_runs_alone_unless_told(tmp_path):
    passed_run(tmp_path, "done", (2, 4, 6))
    passed_run(tmp_path, "failed", (2, 4, 6))
    (tmp_path / "failed" / "report.json").write_text(json.dumps({"status": "failed"}))
    passed_run(tmp_path, "crashed", (2, 4))
    (tmp_path / "crashed" / "report.json").unlink()
    passed_run(tmp_path, "running", (2, 4, 6))
    (tmp_path / "running" / "report.json").unlink()
    with lease.held(str(tmp_path / "running"), "running"):
        dry = {r.run_id: r for r in retention.prune(str(tmp_path), 1, None, dry_run=True)}
        assert {k: (r.status, [d.step for d in r.deletions], r.skipped is not None) for k, r in dry.items()} == {
            "done": ("passed", [2], False), "failed": ("failed", [], True), "crashed": ("unfinished", [], True),
            "running": ("running", [], True)}
        assert states(tmp_path / "done") == {2: True, 4: True, 6: True}  # dry: nothing deleted
        wet = {r.run_id: r for r in retention.prune(str(tmp_path), 1, None, include_failed=True)}
        assert [d.step for d in wet["failed"].deletions] == [2] and wet["crashed"].deletions == []
        assert wet["running"].skipped and states(tmp_path / "running") == {2: True, 4: True, 6: True}
    assert not (tmp_path / "running" / lease.LEASE).exists()
    assert retention.run_status(str(tmp_path / "running")) == "unfinished"


def test_a_lease_not_renewed_expires(tmp_path):
    """For `txflow prune` (which only leaves a live run alone), another host's lease counts as its holder's
    until its expiry; one of this host counts as long as its process lives, renewed or not."""
    root = tmp_path / "r"
    root.mkdir()
    now = time.time()
    (root / lease.LEASE).write_text(json.dumps({"run_id": "r", "host": "another-host", "pid": 1, "renewed_at": now,
                                                "expires_at": now + 0.5}))
    assert lease.alive(str(root))
    time.sleep(0.7)
    assert not lease.alive(str(root))  # its holder stopped renewing it (an orchestrator that died)
    (root / lease.LEASE).unlink()
    with lease.held(str(root), "r", ttl_s=0.5, renew_s=100):
        time.sleep(0.7)
        assert lease.alive(str(root))  # not renewed, but its process on this host lives
    with lease.held(str(tmp_path / "r"), "r", ttl_s=0.5, renew_s=0.1):
        time.sleep(0.8)
        assert lease.alive(str(tmp_path / "r"))  # renewed while its holder lives


@pytest.fixture(params=["local", "memory"])
def run_root(request, tmp_path):
    yield from fresh_root(request.param, tmp_path / "r")


def test_a_second_run_with_a_live_runs_id_is_refused_naming_it(run_root):
    with lease.held(run_root, "r") as path:
        fs, _ = fsspec.core.url_to_fs(run_root)
        first = fs.cat_file(path)
        with pytest.raises(lease.LeaseHeld, match=rf"^Run r is running under {run_root} \(host .*, pid {os.getpid()}, "
                                                  r"lease renewed 0 s ago\): one live run per run id"):
            with lease.held(run_root, "r"):
                pytest.fail("a second holder entered")
        assert fs.cat_file(path) == first  # the live run's lease is untouched
    assert not lease.alive(run_root)
    with lease.held(run_root, "r"):  # ended: the run id is free again
        assert lease.alive(run_root)


def test_of_many_runs_starting_at_once_exactly_one_gets_the_lease(tmp_path):
    fs, root = fsspec.core.url_to_fs(str(tmp_path))
    start, won = threading.Barrier(8), []

    def contender(i):
        start.wait()
        try:
            lease._acquire(fs, f"{root}/{lease.LEASE}", str(tmp_path), f"run{i}", f"token{i}", 600, 60)
            won.append(i)
        except lease.LeaseHeld:
            pass

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 1
    assert json.loads((tmp_path / lease.LEASE).read_text())["run_id"] == f"run{won[0]}"


def test_a_dead_holders_lease_is_taken_over_with_a_log_line(run_root, caplog):
    gone = subprocess.Popen(["true"])
    gone.wait()  # a process of this host that has ended
    fs, root = fsspec.core.url_to_fs(run_root)
    fs.makedirs(root, exist_ok=True)
    now = time.time()
    dead = {"run_id": "old", "host": socket.gethostname(), "pid": gone.pid, "started": 1, "renewed_at": now,
            "expires_at": now + 600}
    silent = {**dead, "host": "another-host", "pid": 1, "renewed_at": now - 700, "expires_at": now - 100}
    # Another host's lease whose own clock says it was last renewed 700 s ago is watched (0.3 s here, the TTL
    # in production), unchanged, before it is taken over.
    for record, why in ((dead, f"its process {gone.pid} on this host is gone"),
                        (silent, "looks not renewed for 70")):
        fs.pipe_file(f"{root}/{lease.LEASE}", json.dumps(record).encode())
        assert not lease.alive(run_root)
        with caplog.at_level(logging.WARNING), lease.held(run_root, "new", ttl_s=0.3):
            assert lease.holder(run_root)["run_id"] == "new"
        assert f"took over the lease of run old under {run_root} " in caplog.text and why in caplog.text
    # Another host's lease, renewed a moment ago: its pid says nothing here, and it is refused.
    fs.pipe_file(f"{root}/{lease.LEASE}", json.dumps({**silent, "renewed_at": now, "expires_at": now + 600}).encode())
    with pytest.raises(lease.LeaseHeld, match="host another-host, pid 1"):
        with lease.held(run_root, "new"):
            pass


def test_a_live_holder_on_this_host_keeps_its_lease_whatever_the_clocks_say(run_root, monkeypatch):
    """The attack: with the reader's clock 601 s ahead of the holder's, the same-host holder's
    lease looked expired and a second run took it over while the first went on. A live process of this host
    holding it now refuses the second run, whatever the timestamps say."""
    with lease.held(run_root, "r"):
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 601)
        with pytest.raises(lease.LeaseHeld, match=f"^Run r is running under {re.escape(run_root)}"):
            with lease.held(run_root, "second"):
                pytest.fail("a second holder entered")
        monkeypatch.setattr(time, "time", real)
        assert lease.holder(run_root)["run_id"] == "r"


def test_another_hosts_lease_that_looks_old_is_kept_when_it_is_renewed_while_watched(run_root, caplog):
    """Another host's clock cannot be compared with this one's: its lease that looks 700 s old is watched,
    and a renewal seen while watching refuses the second run (the holder lives; its clock is behind)."""
    fs, root = fsspec.core.url_to_fs(run_root)
    fs.makedirs(root, exist_ok=True)
    path = f"{root}/{lease.LEASE}"
    now = time.time()
    behind = {"run_id": "old", "host": "another-host", "pid": 1, "renewed_at": now - 700, "expires_at": now - 100}
    fs.pipe_file(path, json.dumps(behind).encode())
    renewal = threading.Timer(0.3, lambda: fs.pipe_file(path, json.dumps({**behind, "renewed_at": now - 640}).encode()))
    renewal.start()
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(lease.LeaseHeld, match="renewed while this run watched"):
            with lease.held(run_root, "second", ttl_s=5):
                pytest.fail("a second holder entered")
    finally:
        renewal.join()
    assert "watching it for 5 s before taking it over" in caplog.text
    assert json.loads(fs.cat_file(path))["run_id"] == "old"


def test_a_run_whose_lease_was_taken_over_stops_at_its_next_step_or_commit(run_root):
    """The holder learns of a takeover at its next renewal, and before that at its next step or commit
    (`lease.check`, one read): LeaseLost, in one line, and it leaves the other run's lease."""
    with lease.held(run_root, "r", renew_s=600) as path:
        lease.check(run_root)  # its own: passes
        fs, _ = fsspec.core.url_to_fs(run_root)
        fs.pipe_file(path, json.dumps({"run_id": "other", "host": "another-host", "pid": 1, "renewed_at": time.time(),
                                       "expires_at": time.time() + 600}).encode())
        with pytest.raises(lease.LeaseLost) as lost:
            lease.check(run_root)
        assert "\n" not in str(lost.value) and "(by run other on host another-host); this run stops" in str(lost.value)
        with pytest.raises(lease.LeaseLost):
            storage.commit(SimpleNamespace(run_root=run_root, run_id="r", plain_storage_options=dict), "unused",
                           "tinker://r/weights/step-000001")
    assert lease.holder(run_root)["run_id"] == "other"


@pytest.fixture
def slow_takeovers(monkeypatch):
    """Every run that finds the lease dead reads it before any takes it over, and each replace waits 0.02 s:
    a takeover that is not one compare-and-swap lets two in."""
    stale, replace = lease.stale, os.replace

    def slow_stale(record):
        time.sleep(0.1)
        return stale(record)

    def slow_replace(*args):
        time.sleep(0.02)
        return replace(*args)

    monkeypatch.setattr(lease, "stale", slow_stale)
    monkeypatch.setattr(os, "replace", slow_replace)


def test_of_many_runs_taking_over_one_dead_lease_at_once_exactly_one_gets_it(tmp_path, slow_takeovers):
    """The takeover is a compare-and-swap under the run root's flock: the others find the winner's live lease."""
    won = lease_race(str(tmp_path / "r"))
    assert len(won) == 1, won
    assert json.loads((tmp_path / "r" / lease.LEASE).read_text())["run_id"] == won[0]


def test_a_lease_that_keeps_changing_under_each_read_counts_as_changed_while_watched(monkeypatch):
    """On S3 a read fails (EINVAL, or s3fs's FileExpired) when the lease changed between s3fs's HEAD and GET;
    when it does so at each of the reader's tries, other runs are writing it: a run watching it (before a
    takeover) learns it changed, and does not crash. Seen on CI: a contender in the S3 takeover race died of it."""
    import errno

    from s3fs.utils import FileExpired

    for error in (OSError(errno.EINVAL, "At least one of the pre-conditions you specified did not hold"),
                  FileExpired("lease.json", '"etag-1"')):
        def changing(fs, path, error=error):
            raise error

        monkeypatch.setattr(lease, "_read", changing)
        assert lease._unchanged_for(None, "lease", "etag-1", ttl_s=0.2, poll_s=0.01) is None

    def failing(fs, path):
        raise OSError(errno.EACCES, "denied")

    monkeypatch.setattr(lease, "_read", failing)
    with pytest.raises(PermissionError):
        lease._unchanged_for(None, "lease", "etag-1", ttl_s=0.2, poll_s=0.01)


@pytest.mark.parametrize(("code", "status", "lost"), [("PreconditionFailed", 412, True),
                                                   ("ConditionalRequestConflict", 409, True), ("SlowDown", 503, False)])
def test_an_s3_write_that_another_write_beat_is_a_lost_race_and_nothing_else_is(code, status, lost):
    """S3 answers one of two concurrent conditional writes 412, or 409 (retry): either way the other run won."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    error = ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                        "PutObject")
    assert lease._conflict(translate_boto_error(error)) is lost


def test_a_holder_taken_over_learns_it_at_its_next_renewal_and_leaves_the_new_lease(run_root):
    after, messages = taken_over_while_held(run_root)
    assert after is not None and after["run_id"] == "other"  # neither renewed over nor deleted by the old holder
    assert [m for m in messages if m == f"run r: its lease of {run_root} was taken over (by run other on host "
                                        f"another-host); this run stops here, before it writes more under a run "
                                        f"root that is another run's now"], messages
    after, _ = taken_over_while_held(f"{run_root}/released", renew=False)
    assert after is not None and after["run_id"] == "other"  # its release left the other run's lease


# --- promotion -------------------------------------------------------------------------------------------


def committed_export(root: Path, name: str) -> tuple[str, dict[str, bytes]]:
    """A committed PEFT export: its URL and {file: content}."""
    local = root.with_name(root.name + "-staging") / name
    local.mkdir(parents=True)
    files = {"adapter_config.json": json.dumps({"name": name}).encode(), "adapter_model.safetensors": os.urandom(500)}
    for file, content in files.items():
        (local / file).write_bytes(content)
    return storage.upload(local, str(root / name / "export" / "peft"), {}, "an export"), files


def read_promoted(checkpoints: str, name: str) -> dict[str, bytes]:
    """What a reader of the promotion sees: the pointer first, then the files it names."""
    current = promotion.current(checkpoints, name)
    peft = Path(current["files"]["peft"])
    return {p.name: p.read_bytes() for p in sorted(peft.iterdir())}


def test_a_promotion_replaces_the_previous_one_whole_and_keeps_five_before_it(tmp_path):
    checkpoints = str(tmp_path / "ckpt")
    exports = [committed_export(tmp_path, f"run{i}") for i in range(8)]
    ids = []
    for i, (url, files) in enumerate(exports):
        result = promotion.promote(checkpoints, "prod", f"run{i}", {"peft": url}, {"figures": {"i": i}})
        ids.append(result.id)
        assert read_promoted(checkpoints, "prod") == files
        assert promotion.current(checkpoints, "prod")["figures"] == {"i": i}
        time.sleep(0.002)  # ids are by the millisecond
    kept = promotion.history(checkpoints, "prod")
    assert [r["id"] for r in kept] == ids[::-1][:6]  # the current one and the 5 before it
    assert kept[0]["previous"] == ids[-2]
    assert not (tmp_path / "ckpt" / "promoted" / "prod" / "history" / ids[0]).exists()


def test_a_promotion_that_fails_leaves_the_pointer_as_it_was(tmp_path):
    checkpoints = str(tmp_path / "ckpt")
    good, files = committed_export(tmp_path, "good")
    promotion.promote(checkpoints, "prod", "good", {"peft": good}, {})
    bad, _ = committed_export(tmp_path, "bad")
    with open(Path(bad) / "adapter_model.safetensors", "r+b") as f:  # changed after its commit
        first = f.read(1)[0]
        f.seek(0)
        f.write(bytes([first ^ 0xFF]))  # a byte that differs from the one there (the content is random)
    with pytest.raises(ValueError, match="is not the committed one"):
        promotion.promote(checkpoints, "prod", "bad", {"peft": bad}, {})
    assert read_promoted(checkpoints, "prod") == files
    assert [r["run_id"] for r in promotion.history(checkpoints, "prod")] == ["good"]


def test_retention_never_deletes_what_a_promotion_was_made_from(tmp_path):
    checkpoints = tmp_path / "ckpt"
    urls = passed_run(checkpoints, "r", (2, 4, 6))
    export_url, _ = committed_export(checkpoints, "r-export")
    promotion.promote(str(checkpoints), "prod", "r", {"peft": export_url}, {"sources": {"state": urls[2]}})
    protected = promotion.sources(str(checkpoints))
    assert urls[2] in protected
    [run] = [r for r in retention.prune(str(checkpoints), 1, None, protected=protected) if r.run_id == "r"]
    assert run.deletions == [] and states(checkpoints / "r") == {2: True, 4: True, 6: True}


KEY = "signing-key-of-the-promotions-0123"


def test_what_serving_reads_names_only_the_promotions_own_files(tmp_path):
    """Without a key: a bucket writer pointed `current.json` at `../` paths and
    `promotion.json` at another bucket, and `current()` returned them. Now either is refused in one line."""
    checkpoints = str(tmp_path / "ckpt")
    url, files = committed_export(tmp_path, "good")
    promoted = promotion.promote(checkpoints, "prod", "good", {"peft": url}, {})
    base = Path(checkpoints) / "promoted" / "prod"
    pointer, record = base / "current.json", base / "history" / promoted.id / "promotion.json"
    good_pointer, good_record = pointer.read_bytes(), record.read_bytes()
    for path in ("promoted/prod/../../../evil", f"history/{promoted.id}/../../../../evil", "/etc"):
        pointer.write_text(json.dumps({**json.loads(good_pointer), "path": path}))
        with pytest.raises(ValueError, match=f"current.json points at '{re.escape(path)}', not at a promotion"):
            promotion.current(checkpoints, "prod")
    pointer.write_bytes(good_pointer)
    for elsewhere in ("s3://attacker/adapter", f"{base}/history/{promoted.id}/../../other/peft"):
        record.write_text(json.dumps({**json.loads(good_record), "files": {"peft": elsewhere}}))
        with pytest.raises(ValueError, match="promotion.json names files .*, not this promotion's own"):
            promotion.current(checkpoints, "prod")
    record.write_bytes(good_record)
    assert read_promoted(checkpoints, "prod") == files


def test_with_a_key_the_pointer_the_record_and_the_files_serving_reads_are_signed_for_their_paths(
        tmp_path, monkeypatch):
    """With a signing key, `current.json` and `promotion.json` are signed for their paths and `current()`
    verifies each file's marker: an unsigned pointer, another promotion's record put in place, or another
    promotion's adapter copied over this one's are refused, each in one line; the genuine one reads back."""
    monkeypatch.setenv("TXFLOW_SIGNING_KEY", KEY)
    checkpoints = str(tmp_path / "ckpt")
    (first, _), (second, files) = committed_export(tmp_path, "one"), committed_export(tmp_path, "two")
    one = promotion.promote(checkpoints, "prod", "one", {"peft": first}, {})
    time.sleep(0.002)
    two = promotion.promote(checkpoints, "prod", "two", {"peft": second}, {})
    assert read_promoted(checkpoints, "prod") == files
    base = Path(checkpoints) / "promoted" / "prod"
    pointer = base / "current.json"
    assert "hmac" in json.loads(pointer.read_bytes()) and "hmac" not in promotion.current(checkpoints, "prod")
    good = pointer.read_bytes()

    pointer.write_text(json.dumps({"id": two.id, "path": f"history/{two.id}", "run_id": "two", "promoted_at": 1}))
    with pytest.raises(ValueError, match="current.json: it is not signed, and a signing key is set"):
        promotion.current(checkpoints, "prod")
    pointer.write_bytes(good)

    records = [base / "history" / i / "promotion.json" for i in (one.id, two.id)]
    kept = records[1].read_bytes()
    records[1].write_bytes(records[0].read_bytes())
    with pytest.raises(ValueError, match=f"signed for 'promoted/prod/history/{re.escape(one.id)}/promotion.json', "
                                         f"not for where it is stored"):
        promotion.current(checkpoints, "prod")
    records[1].write_bytes(kept)

    ours, theirs = base / "history" / two.id / "peft", base / "history" / one.id / "peft"
    for file in theirs.iterdir():
        (ours / file.name).write_bytes(file.read_bytes())
    (ours.parent / ("peft" + COMMIT_SUFFIX)).write_bytes((theirs.parent / ("peft" + COMMIT_SUFFIX)).read_bytes())
    with pytest.raises(ValueError, match=f"signed for 'promoted/prod/history/{re.escape(one.id)}/peft', not for"):
        promotion.current(checkpoints, "prod")


def test_a_promotion_copies_only_what_was_committed(tmp_path):
    """A file added to a committed export after its commit is not published under a fresh marker: the
    promotion is refused, and the pointer stays."""
    checkpoints = str(tmp_path / "ckpt")
    good, files = committed_export(tmp_path, "good")
    promotion.promote(checkpoints, "prod", "good", {"peft": good}, {})
    added, _ = committed_export(tmp_path, "added")
    (Path(added) / "extra.pth").write_text("import os")
    with pytest.raises(ValueError, match="'extra.pth' is not recorded in its commit marker"):
        promotion.promote(checkpoints, "prod", "added", {"peft": added}, {})
    assert read_promoted(checkpoints, "prod") == files
    assert not list((tmp_path / "ckpt").rglob("extra.pth"))


def test_trim_follows_the_pointers_history_not_the_ids(tmp_path, monkeypatch):
    """Ids are wall-clock times of whichever machine promoted: a promotion made with a clock years ahead is
    still trimmed once the pointer has moved past it 6 times, and a promotion still uploading on a machine
    whose clock is behind (its directory has no record yet) is never trimmed."""
    checkpoints = str(tmp_path / "ckpt")
    history_dir = tmp_path / "ckpt" / "promoted" / "prod" / "history"
    ahead = "29991231T235959.999Z-ahead"
    monkeypatch.setattr(promotion, "new_id", lambda run_id: ahead)
    promotion.promote(checkpoints, "prod", "ahead", {"peft": committed_export(tmp_path, "ahead")[0]}, {})
    monkeypatch.undo()
    in_flight = history_dir / "19700101T000000.000Z-behind" / "peft"
    in_flight.mkdir(parents=True)
    (in_flight / "adapter_config.json").write_text("{}")  # half uploaded: no marker, no record, no pointer
    ids = [ahead]
    for i in range(6):
        ids.append(promotion.promote(checkpoints, "prod", f"run{i}", {"peft": committed_export(tmp_path, f"r{i}")[0]},
                                     {}).id)
        time.sleep(0.002)
    assert not (history_dir / ahead).exists()  # the pointer moved past it 6 times
    assert [r["id"] for r in promotion.history(checkpoints, "prod")] == ids[:0:-1]
    assert (in_flight / "adapter_config.json").exists()


def test_a_trim_that_fails_after_the_pointer_moved_leaves_the_promotion_standing(tmp_path, monkeypatch, capsys):
    checkpoints = str(tmp_path / "ckpt")
    ids = [promotion.promote(checkpoints, "prod", f"run{i}", {"peft": committed_export(tmp_path, f"r{i}")[0]}, {}).id
           for i in range(6)]
    real_delete = retention.delete

    def store_away(*args, **kwargs):
        raise OSError("the store went away")

    monkeypatch.setattr(retention, "delete", store_away)
    url, files = committed_export(tmp_path, "new")
    result = promotion.promote(checkpoints, "prod", "new", {"peft": url}, {})
    assert result.status == "promoted" and result.trim_error == "OSError: the store went away"
    assert read_promoted(checkpoints, "prod") == files  # the pointer names the new one, whole
    assert len(promotion.history(checkpoints, "prod")) == 7  # nothing was deleted, nothing published twice
    monkeypatch.setattr(retention, "delete", real_delete)
    passed_run(tmp_path / "ckpt", "r", (2,))
    assert cli.main(["prune", checkpoints, "--keep-last", "1", "--json"]) == 0  # the next prune finishes it
    removed = json.loads(capsys.readouterr().out)["promotions_removed"]
    assert removed == [f"{checkpoints}/promoted/prod/history/{ids[0]}"]
    assert [r["id"] for r in promotion.history(checkpoints, "prod")] == [result.id, *ids[:0:-1]]


def test_the_approver_is_prefects_sender_else_the_name_given_else_unknown():
    """Prefect 3.9.1's server knows no user: a sender is stored only when the answer was written with one."""
    assert promote.approver("prefect.flow-run.x", "alice") == "prefect.flow-run.x (the sender Prefect stored " \
                                                               "with the answer)"
    assert promote.approver(None, " alice ") == "alice (named in the approval form; the Prefect server records " \
                                                  "no user)"
    assert promote.approver(None, "  ") == promote.approver(None, None) == \
        "unknown (the Prefect server records no user)"


def test_the_report_names_who_answered_the_approval():
    approved = promotion.Promotion(name="prod", status="promoted", url="u", pointer="p", comment="ship it",
                                   approver="alice (named in the approval form; the Prefect server records no user)")
    rejected = approved.model_copy(update={"status": "rejected", "approver": "bob (the sender Prefect stored "
                                                                             "with the answer)"})
    lines = lifecycle_markdown(SimpleNamespace(retention=None, promotion=approved))
    assert "- approved by: alice (named in the approval form; the Prefect server records no user)" in lines
    assert "- approver's comment: ship it" in lines
    lines = lifecycle_markdown(SimpleNamespace(retention=None, promotion=rejected))
    assert "- answered by: bob (the sender Prefect stored with the answer)" in lines
    unanswered = approved.model_copy(update={"status": "not approved in time", "approver": None, "comment": None})
    assert not [line for line in lifecycle_markdown(SimpleNamespace(retention=None, promotion=unanswered))
                if " by: " in line]


def test_a_server_that_cannot_say_who_answered_leaves_the_answer_standing(caplog):
    """Who answered is a record, not a condition: a Prefect server out of reach gives no sender, with a warning."""
    import uuid

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}), caplog.at_level(logging.WARNING):
        assert promote.answer_sender(uuid.uuid4(), "paused-1-response") is None
    assert "could not read who answered the approval (ConnectError" in caplog.text
