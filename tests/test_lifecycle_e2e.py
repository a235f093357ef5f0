"""The checkpoint lifecycle end to end on a real S3 API (moto_server): promotion while a reader reads,
a failing run that leaves the promotion alone, keep_last in a run, `txflow prune` over the root, a prune
killed in the middle of a deletion, and a resume from what was pruned.

The tests of this module run in order: each takes the bucket as the one before left it."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
import time

import boto3
import fsspec
import pytest

from tests.helpers import (
    BUCKET,
    HoldingProxy,
    alive_pids,
    bucket_keys,
    lease_race,
    run_txflow,
    taken_over_while_held,
    txflow_cmd,
)
from txflow.checkpoints import lease
from txflow.checkpoints.names import step_of
from txflow.reporting.report import RunReport, markdown

pytestmark = [pytest.mark.e2e, pytest.mark.together, pytest.mark.heavy(7)]

ROOT = f"s3://{BUCKET}/life"
RUN = ["run", "sft", "--base-model", "tiny", "--processes", "1", "--checkpoints", ROOT, "--json"]

# A reader of the promotion, as serving would be: the pointer, then every file of the promotion it names;
# one line per read: the promotion's id and the digest of everything read.
READER = """
import hashlib, json, sys, time
from pathlib import Path
import fsspec
root, out, stop = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
with open(out, "w") as sink:
    while not stop.exists():
        fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)
        try:
            pointer = json.loads(fs.cat_file(f"{root}/current.json"))
        except FileNotFoundError:
            continue
        digest = hashlib.sha256()
        for path in sorted(fs.find(f"{root}/{pointer['path']}/peft")):
            digest.update(path.rsplit("/peft/", 1)[1].encode() + b"\\0" + fs.cat_file(path))
        sink.write(json.dumps({"id": pointer["id"], "digest": digest.hexdigest()}) + "\\n")
        sink.flush()
        time.sleep(0.05)
"""


def promoted_digest(promotion_id: str) -> str:
    """The digest READER computes, of the promotion `promotion_id` as it stands in the bucket."""
    prefix = f"life/promoted/prod/history/{promotion_id}/peft/"
    s3 = boto3.client("s3")
    digest = hashlib.sha256()
    for key in sorted(bucket_keys(prefix)):
        digest.update(key.removeprefix(prefix).encode() + b"\0" + s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    return digest.hexdigest()


def state_steps(run_id: str) -> dict[int, int]:
    """{step: bytes} of the state checkpoints of a run in the bucket (data files only)."""
    steps: dict[int, int] = {}
    for key, size in bucket_keys(f"life/{run_id}/").items():
        match = re.search(r"/step-(\d+)\.tar\.gz/", key)
        if match:
            steps[int(match[1])] = steps.get(int(match[1]), 0) + size
    return steps


def pointer() -> bytes:
    return boto3.client("s3").get_object(Bucket=BUCKET, Key="life/promoted/prod/current.json")["Body"].read()


def test_two_passing_runs_promote_in_turn_and_a_reader_never_sees_a_mix(tmp_path, s3_env, reaper):
    state_a, state_b = reaper.watch(tmp_path / "a"), reaper.watch(tmp_path / "b")
    # Run A: keep_last 1 over 10 steps saved every 2: the final state and the one before it stay.
    first = run_txflow([*RUN, "--run-id", "life-a", "--steps", "10", "--save-every", "2", "--keep-last", "1",
                        "--promote-as", "prod", "--state-dir", str(state_a)], s3_env, tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    report_a = json.loads(first.stdout)
    assert report_a["status"] == "passed"
    assert sorted(state_steps("life-a")) == [8, 10]
    assert report_a["checkpoints"]["sampler"]["url"].removeprefix(f"s3://{BUCKET}/") in bucket_keys("life/life-a/")
    retention = report_a["retention"]
    assert [d["step"] for d in retention["deleted"]] == [2, 4, 6] and retention["keep_last"] == 1
    assert retention["bytes_freed"] == sum(d["bytes"] for d in retention["deleted"]) > 0
    assert sorted(step_of(a["path"]) for a in report_a["artifacts"] if a["kind"] == "state") == [8, 10]
    assert report_a["promotion"]["status"] == "promoted"
    id_a = report_a["promotion"]["id"]
    text = markdown(RunReport.model_validate(report_a))
    assert "promoted as **prod**" in text and "## Retention" in text

    # Run B replaces it while a reader loops over promoted/prod.
    reads, stop = tmp_path / "reads.jsonl", tmp_path / "stop-reading"
    reader = subprocess.Popen([sys.executable, "-c", READER, f"{BUCKET}/life/promoted/prod", str(reads), str(stop)],
                              env=s3_env, stderr=subprocess.PIPE, text=True)
    try:
        second = run_txflow([*RUN, "--run-id", "life-b", "--steps", "6", "--save-every", "2", "--promote-as", "prod",
                             "--state-dir", str(state_b)], s3_env, tmp_path)
        deadline = time.monotonic() + 30
        while not (reads.exists() and any(json.loads(line)["id"] != id_a for line in reads.read_text().splitlines())):
            assert reader.poll() is None, reader.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the reader never saw the new promotion"
            time.sleep(0.2)
    finally:
        stop.touch()
        reader.wait(timeout=60)
    assert reader.returncode == 0, reader.stderr.read()[-3000:]
    assert second.returncode == 0, second.stderr[-4000:]
    report_b = json.loads(second.stdout)
    id_b = report_b["promotion"]["id"]
    digests = {id_a: promoted_digest(id_a), id_b: promoted_digest(id_b)}
    seen = [json.loads(line) for line in reads.read_text().splitlines()]
    assert {r["id"] for r in seen} == {id_a, id_b} and len(seen) > 20, len(seen)
    assert [r for r in seen if digests[r["id"]] != r["digest"]] == []  # every read was one promotion, whole
    # What each promotion holds is its run's export, byte for byte.
    s3 = boto3.client("s3")
    for report, promotion_id in ((report_a, id_a), (report_b, id_b)):
        run_prefix = report["export"]["peft_url"].removeprefix(f"s3://{BUCKET}/") + "/"
        for key in bucket_keys(run_prefix):
            promoted_key = f"life/promoted/prod/history/{promotion_id}/peft/{key.removeprefix(run_prefix)}"
            assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == \
                s3.get_object(Bucket=BUCKET, Key=promoted_key)["Body"].read()

    shown = run_txflow(["promoted", ROOT, "prod"], s3_env, tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("prod: run life-b (sft, base model ") and f"history: {id_a} (run life-a)" in \
        shown.stdout
    assert re.search(r"eval_loss_gain: \d", shown.stdout) and "export_max_abs_logprob_diff" in shown.stdout
    record = json.loads(run_txflow(["promoted", ROOT, "prod", "--json"], s3_env, tmp_path).stdout)["current"]
    assert record["run_id"] == "life-b" and record["previous"] == id_a
    assert record["sources"]["sampler"] == report_b["checkpoints"]["sampler"]["url"]
    assert set(record["versions"]) == {"skyrl_tx", "tinker", "jax", "txflow_commit"}
    assert alive_pids(state_a) == [] and alive_pids(state_b) == []


def test_a_run_that_fails_its_checks_leaves_the_promotion_and_names_the_check(tmp_path, s3_env, reaper):
    """A learning rate of 1e-9 trains nothing: the run fails, its last line, report and markdown name the
    check with its value and bound, and promoted/prod is as it was, byte for byte."""
    state = reaper.watch(tmp_path / "c")
    before = pointer()
    result = run_txflow([*RUN[:-1], "--run-id", "life-c", "--steps", "6", "--save-every", "2", "--learning-rate",
                         "1e-9", "--promote-as", "prod", "--state-dir", str(state)], s3_env, tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("txflow: run life-c failed (checks failed: "), last
    assert re.search(r"SFT held-out gain -?0\.00\d nats < 0\.05 required", last), last
    # `txflow runs` lists the three, newest first: how each ended, the adapter of those that passed.
    listed = run_txflow(["runs", ROOT, "--json"], s3_env, tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = {r["run_id"]: r for r in json.loads(listed.stdout)}
    assert [r["run_id"] for r in json.loads(listed.stdout)][0] == "life-c"
    assert rows["life-c"]["status"] == "failed" and rows["life-c"]["error"].startswith("checks failed: ")
    assert rows["life-a"]["status"] == "passed" and rows["life-a"]["adapter"] == f"{ROOT}/life-a/export/peft"
    assert rows["life-c"]["adapter"] is None and rows["life-a"]["mode"] == "sft"
    assert "the trained model's greedy tokens are the base model's" in last
    report = json.loads(boto3.client("s3").get_object(Bucket=BUCKET, Key="life/life-c/report.json")["Body"].read())
    assert report["status"] == "failed" and report["error"].startswith("checks failed: ")
    restore = report["restore"]
    # Only the quality checks failed: the restore itself reproduced the live model.
    assert restore["abs_diff"] <= 1e-4 and restore["sampler_tokens_match"]
    moved, gain = restore["failed_checks"]
    assert moved.startswith("the trained model's greedy tokens are the base model's") and \
        gain.startswith("SFT held-out gain"), restore["failed_checks"]
    assert f"- failed check: **{gain}**" in markdown(RunReport.model_validate(report))
    assert report["promotion"] is None and pointer() == before
    assert sorted(state_steps("life-c")) == [2, 4, 6]
    assert alive_pids(state) == []


def test_prune_over_the_root_frees_the_bytes_it_says(tmp_path, s3_env):
    before = {run: state_steps(run) for run in ("life-a", "life-b", "life-c")}
    dry = run_txflow(["prune", ROOT, "--keep-last", "1", "--dry-run", "--json"], s3_env, tmp_path)
    assert dry.returncode == 0, dry.stderr
    planned = json.loads(dry.stdout)
    runs = {r["run_id"]: r for r in planned["runs"]}
    assert set(runs) == {"life-a", "life-b", "life-c"}  # promoted/ is no run
    assert [d["step"] for d in runs["life-b"]["deletions"]] == [2] and runs["life-a"]["deletions"] == []
    assert runs["life-c"]["status"] == "failed" and runs["life-c"]["skipped"]
    assert {run: state_steps(run) for run in before} == before  # dry: nothing went

    done = run_txflow(["prune", ROOT, "--keep-last", "1", "--json"], s3_env, tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["bytes_freed"] == planned["bytes_freed"] == before["life-b"][2]
    assert state_steps("life-b") == {s: b for s, b in before["life-b"].items() if s != 2}
    assert state_steps("life-a") == before["life-a"] and state_steps("life-c") == before["life-c"]
    assert "txflow: deleted 1 checkpoints of 3 runs" in done.stderr


def test_a_prune_killed_mid_deletion_reads_incomplete_and_the_next_one_finishes(tmp_path, s3_env, moto):
    """SIGKILL while the data of a checkpoint is being deleted (its marker already gone): `txflow discover`
    reads it incomplete; a second prune finishes; a resume from it is refused naming the newest state."""
    server, _ = moto
    proxy = HoldingProxy(server.port, hold_on=b"?delete")  # S3's DeleteObjects: the checkpoint's data
    env = s3_env | {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
    prune = subprocess.Popen(txflow_cmd("prune", ROOT, "--keep-last", "1", "--include-failed"), env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proxy.held.wait(timeout=120), prune.communicate(timeout=5)
        prune.send_signal(signal.SIGKILL)
        prune.wait(timeout=30)
    finally:
        if prune.poll() is None:
            prune.kill()
        proxy.stop()
    step2 = f"{ROOT}/life-c/" + next(k for k in bucket_keys("life/life-c/") if "step-000002.tar.gz/" in k) \
        .removeprefix("life/life-c/").split(".tar.gz/")[0] + ".tar.gz"
    assert state_steps("life-c")[2] > 0  # the data is still there, the marker is not
    assert step2.removeprefix(f"s3://{BUCKET}/") + ".txflow-commit" not in bucket_keys("life/life-c/")
    listed = run_txflow(["discover", f"{ROOT}/life-c", "--json"], s3_env, tmp_path)
    assert listed.returncode == 1
    [found] = [a for a in json.loads(listed.stdout) if a["url"] == step2]
    assert not found["complete"] and "being pruned" in found["reason"]

    again = run_txflow(["prune", ROOT, "--keep-last", "1", "--include-failed", "--json"], s3_env, tmp_path)
    assert again.returncode == 0, again.stderr
    finished = {r["run_id"]: r for r in json.loads(again.stdout)["runs"]}["life-c"]["deletions"]
    assert [(d["step"], d["reason"]) for d in finished] == [(2, "a prune stopped half-way")]
    assert sorted(state_steps("life-c")) == [4, 6]

    resumed = run_txflow(["run", "sft", "--base-model", "tiny", "--run-id", "life-d", "--checkpoints", ROOT,
                          "--resume-from", step2,
                          "--state-dir", str(tmp_path / "d")], s3_env, tmp_path, timeout=120)
    assert resumed.returncode == 2, resumed.stderr
    lines = resumed.stderr.strip().splitlines()
    assert len(lines) == 1, resumed.stderr
    line = lines[0]
    assert re.search(r"was pruned on .* \(beyond the newest 1 periodic states\); the newest state still there is "
                     r"s3://.*/life-c/.*step-000006\.tar\.gz \(step 6\)", line), line


def held_and_taken_over_then_checked(run_root: str) -> None:
    """A run holds `run_root`'s lease, another run's is written over it, and the holder checks before its next
    step (as the training loop and every commit do): LeaseLost."""
    with lease.held(run_root, "r", renew_s=600) as path:
        fs, _ = fsspec.core.url_to_fs(run_root)
        fs.pipe_file(path, json.dumps({"run_id": "other", "host": "another-host", "pid": 1}).encode())
        lease.check(run_root)


def test_of_many_runs_taking_over_one_dead_lease_on_s3_exactly_one_gets_it(s3_env, monkeypatch):
    """On S3 a takeover is a PUT with `If-Match` the dead lease's ETag: of 8 runs that all read the dead lease
    before any wrote, one replaces it and the others find its live lease."""
    stale = lease.stale
    monkeypatch.setattr(lease, "stale", lambda record: time.sleep(0.1) or stale(record))
    won = lease_race(f"s3://{BUCKET}/leases/race")
    assert len(won) == 1, won
    assert lease.holder(f"s3://{BUCKET}/leases/race")["run_id"] == won[0]


def test_a_holder_taken_over_on_s3_learns_it_at_its_next_renewal_and_leaves_the_new_lease(s3_env):
    """Renewals are PUTs with `If-Match` the holder's own last ETag, the release a DELETE with it: neither
    touches the lease another run wrote over it."""
    after, messages = taken_over_while_held(f"s3://{BUCKET}/leases/renewal")
    assert after is not None and after["run_id"] == "other"
    assert [m for m in messages if "was taken over (by run other on host another-host)" in m], messages
    with pytest.raises(lease.LeaseLost, match="this run stops here"):
        held_and_taken_over_then_checked(f"s3://{BUCKET}/leases/checked")
    after, _ = taken_over_while_held(f"s3://{BUCKET}/leases/release", renew=False)
    assert after is not None and after["run_id"] == "other"  # its release left the other run's lease


def test_txflow_prune_on_s3_deletes_nothing_for_a_planted_pruning_file(s3_env, tmp_path):
    """The attack on a real S3 API, through `txflow prune`: a `<model dir>.txflow-pruning` that
    a bucket writer put there is named and left; the model directory and every state in it stay."""
    from txflow.checkpoints import storage
    from txflow.checkpoints.markers import PRUNING_SUFFIX
    from txflow.upstream.skyrl_tx.layout import STATE_FILE

    root = f"s3://{BUCKET}/planted"
    for step in (2, 4, 6):
        local = tmp_path / f"step-{step:06d}"
        local.mkdir()
        (local / STATE_FILE).write_bytes(f"state {step}".encode())
        storage.upload(local, f"{root}/r/m1/step-{step:06d}.tar.gz", {}, f"step {step}")
    s3 = boto3.client("s3")
    s3.put_object(Bucket=BUCKET, Key="planted/r/report.json", Body=json.dumps({"status": "passed"}).encode())
    s3.put_object(Bucket=BUCKET, Key=f"planted/r/m1{PRUNING_SUFFIX}", Body=b"{}")
    done = run_txflow(["prune", root, "--keep-last", "5", "--json"], s3_env, tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["runs"][0]["deletions"] == [], done.stdout
    assert f"m1{PRUNING_SUFFIX} does not record a deletion of this state checkpoint" in done.stderr
    kept = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="planted/r/m1/")["Contents"]}
    assert {f"planted/r/m1/step-{s:06d}.tar.gz/{STATE_FILE}" for s in (2, 4, 6)} <= kept
