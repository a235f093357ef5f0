"""Durable checkpoints on a real S3 API (moto_server on 127.0.0.1)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import sqlite3
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path

import boto3
import fsspec
import pytest
import s3fs

from tests.helpers import (
    API_KEY_MARKER,
    BUCKET,
    LOAD_PEFT_AND_GREEDY,
    PASSWORD_MARKER,
    S3_SECRET_MARKER,
    TcpProxy,
    alive_pids,
    bucket_keys,
    descendants,
    private_mounts_work,
    run_txflow,
    txflow_cmd,
    until_eos,
)
from txflow.checkpoints import storage
from txflow.checkpoints.discovery import discover
from txflow.checkpoints.markers import COMMIT_SUFFIX, SIGNING_KEY_ENV
from txflow.cluster.launchers.local import ISOLATE_WORKER_DISKS_ENV
from txflow.config import RunConfig
from txflow.upstream.skyrl_tx.layout import STATE_FILE

pytestmark = [pytest.mark.e2e, pytest.mark.together, pytest.mark.heavy(3)]

SHARED_DISK_OPT_OUT = "TXFLOW_TEST_ALLOW_SHARED_WORKER_DISK"
STORAGE_OPTION_MARKER = "storage-option-MARKER-5d1e"
SIGNATURE_MARKER = "sig-MARKER-e07b"
BUNDLED_SFT = Path(storage.__file__).parents[1] / "data" / "sft.jsonl"


def run_watching_processes(args: list[str], env: dict, cwd: Path) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """`txflow ARGS` to completion; also {pid: (command line, environment)} of the txflow process and of
    every process it started, read from /proc while they ran, and {pid: its parent's pid}. Each is the last one
    read: a child read between its fork and its exec still shows its parent's (command line and credentials),
    which the exec replaces."""
    out, err = cwd / "watched.out", cwd / "watched.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(txflow_cmd(*args), env=env, cwd=cwd, stdout=stdout, stderr=stderr)
        seen: dict[int, tuple[str, str]] = {}
        parents: dict[int, int] = {}
        try:
            deadline = time.monotonic() + 800
            while proc.poll() is None:
                assert time.monotonic() < deadline, "the run did not finish"
                for pid in [proc.pid, *(pid for pid, _ in descendants(proc.pid))]:
                    try:
                        read = tuple(Path(f"/proc/{pid}/{name}").read_bytes().replace(b"\0", b" ")
                                     .decode(errors="replace") for name in ("cmdline", "environ"))
                        if read[0]:  # (a process that has exited, not yet reaped, reads empty)
                            seen[pid] = read
                            # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses
                            parents[pid] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                    except OSError:
                        pass
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(args, proc.returncode, out.read_text(), err.read_text()), seen, parents


def test_sft_on_s3_is_durable_and_a_fresh_run_resumes_from_the_bucket(tmp_path, s3_env, reaper, postgres):
    first_state, second_state = reaper.watch(tmp_path / "s1"), reaper.watch(tmp_path / "s2")
    root = f"s3://{BUCKET}/runs"
    # Rank 1 runs with its own empty state directory (a private tmpfs), as on another node: the
    # ranks share no filesystem, so saves, restores and the resume must not need one.
    isolated = private_mounts_work()
    if isolated:
        s3_env = s3_env | {ISOLATE_WORKER_DISKS_ENV: "1"}
    elif os.environ.get(SHARED_DISK_OPT_OUT) == "1":
        warnings.warn(f"unshare --mount is not permitted here and {SHARED_DISK_OPT_OUT}=1: the ranks of this test "
                      "share a disk, so it does not prove that checkpoints need no shared filesystem", stacklevel=2)
    else:
        pytest.fail(f"unshare --mount is not permitted here, so rank 1 cannot get a private disk and this test "
                    f"would not prove that checkpoints need no shared filesystem. Run as root on Linux, or set "
                    f"{SHARED_DISK_OPT_OUT}=1 to run it with a shared disk anyway")
    # The first run carries five secrets: a database password, the S3 secret key (AWS_*), a Tinker API key
    # and a storage option, each in the environment, none on a command line; and a dataset URL whose
    # query string holds a signature (the bundled dataset, under a key that ends `?sig=...`). The
    # command line and environment of each of its processes are read while it runs.
    dataset_key = f"data/sft.jsonl?sig={SIGNATURE_MARKER}"
    boto3.client("s3").put_object(Bucket=BUCKET, Key=dataset_key, Body=BUNDLED_SFT.read_bytes())
    env = s3_env | {"TINKER_API_KEY": API_KEY_MARKER, "TXFLOW_DATABASE_URL": postgres("tinker_s3"),
                    "TXFLOW_STORAGE_OPTIONS": json.dumps({"key": "txflow-test", "secret": STORAGE_OPTION_MARKER})}
    first, processes, parents = run_watching_processes(
        ["run", "sft", "--base-model", "tiny", "--run-id", "s3-first", "--steps", "8", "--save-every", "3",
         "--checkpoints", root,
         "--state-dir", str(first_state), "--dataset", f"s3://{BUCKET}/{dataset_key}", "--json"], env, tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    command_lines = {pid: line for pid, (line, _) in processes.items()}
    # api, rank 0, rank 1, the embedded Prefect server (and its guard) were all seen running.
    assert sum("txflow.upstream.skyrl_tx" in c for c in command_lines.values()) >= 3, command_lines
    assert any("prefect.server.api.server:create_app" in c for c in command_lines.values()), command_lines
    report = json.loads(first.stdout)
    assert report["status"] == "passed" and report["restore"]["abs_diff"] <= 1e-6

    # Every file of the state directory and the sampler tarball are in the bucket, with commit markers.
    keys = bucket_keys("runs/s3-first/")
    state_url = report["checkpoints"]["state"]["url"]
    state_prefix = state_url.removeprefix(f"s3://{BUCKET}/")
    sidecar = json.loads(boto3.client("s3").get_object(Bucket=BUCKET, Key=state_prefix + COMMIT_SUFFIX)["Body"].read())
    assert {f"{state_prefix}/{name}": entry["size"] for name, entry in sidecar["files"].items()}.items() <= keys.items()
    assert list(sidecar["files"]) == [STATE_FILE]
    assert sidecar["files"][STATE_FILE]["size"] == keys[f"{state_prefix}/{STATE_FILE}"]
    body = boto3.client("s3").get_object(Bucket=BUCKET, Key=f"{state_prefix}/{STATE_FILE}")["Body"].read()
    assert sidecar["files"][STATE_FILE]["md5"] == hashlib.md5(body).hexdigest()
    sampler_key = report["checkpoints"]["sampler"]["url"].removeprefix(f"s3://{BUCKET}/")
    assert sampler_key in keys and sampler_key + COMMIT_SUFFIX in keys
    assert {"runs/s3-first/report.json", "runs/s3-first/manifest.json", "runs/s3-first/metrics.jsonl"} <= set(keys)
    # Nothing of the run stayed only in a local cache: the state restores from the bucket alone.
    assert storage.latest_state(f"{root}/s3-first").url == state_url
    # The run exported its adapter into the bucket, proven and committed.
    assert report["export"]["passed"] and report["export"]["peft_url"] == f"{root}/s3-first/export/peft"
    assert {"runs/s3-first/export/peft/adapter_config.json", "runs/s3-first/export/peft/adapter_model.safetensors",
            "runs/s3-first/export/peft.txflow-commit"} <= set(keys)
    # `txflow export` of that run root, from the bucket to the bucket; a separate process loads what it wrote.
    exported = run_txflow(["export", f"{root}/s3-first", "--to", f"s3://{BUCKET}/exports/first", "--json"],
                          s3_env, tmp_path)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert json.loads(exported.stdout)["passed"]
    local = tmp_path / "downloaded"
    fsspec.filesystem("s3").get(f"{BUCKET}/exports/first/peft/", str(local) + "/", recursive=True)
    reference = json.loads(boto3.client("s3").get_object(
        Bucket=BUCKET, Key="runs/s3-first/export-reference.json")["Body"].read())
    loaded = subprocess.run([sys.executable, "-c", LOAD_PEFT_AND_GREEDY, reference["base_model"], str(local),
                             json.dumps(reference["prompts"]), str(len(reference["greedy_tokens"][0]))],
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    greedy = json.loads(loaded.stdout)
    assert greedy["tokens"] == until_eos(reference["greedy_tokens"], greedy["eos"])

    # A second run on a fresh cluster and an empty state directory continues from the step-6 state.
    step6 = next(a["url"] for a in report["artifacts"] if a["path"].endswith("step-000006.tar.gz"))
    second = run_txflow(["run", "sft", "--base-model", "tiny", "--run-id", "s3-second", "--steps", "8",
                         "--resume-from", step6,
                         "--checkpoints", root, "--state-dir", str(second_state), "--json"], s3_env, tmp_path)
    assert second.returncode == 0, second.stderr[-4000:]
    resumed = json.loads(second.stdout)
    assert resumed["resumed_from_step"] == 6
    assert [m["step"] for m in resumed["metrics"]] == [7, 8]
    # Its first step's loss is the loss the first run's step-6 state gives on the same batch (step 7's).
    first_step7 = next(m for m in report["metrics"] if m["step"] == 7)
    assert abs(resumed["metrics"][0]["nll"] - first_step7["nll"]) <= 1e-6
    # Continued to step 8, it ends where the first run ended: the same loss on the same held-out batch.
    assert abs(resumed["restore"]["loss_before"] - report["restore"]["loss_before"]) <= 1e-6
    assert resumed["restore"]["passed"] and resumed["restore"]["sampler_tokens_match"]
    assert alive_pids(first_state) == [] and alive_pids(second_state) == []
    if isolated:  # rank 1 of both runs really saw an empty state directory of its own
        for state in (first_state, second_state):
            assert f"txflow: private node disk: {state} holds 0 entries" in (state / "logs" / "rank1.log").read_text()

    # No secret reached a log, report, manifest, artifact, the Prefect store (its logs and artifacts) or the
    # command line of any process of the run, txflow's own included (but for the dataset URL the user typed
    # there, which Prefect also keeps among the flow's parameters: docs/security.md, "What a run protects against").
    # The environment of each process holds the credentials it uses and no other: the API the key and the
    # database, rank 0 the database, rank 1 and the Prefect server none (AWS_* are the user's own
    # environment, which every process inherits).
    markers = [S3_SECRET_MARKER, PASSWORD_MARKER, API_KEY_MARKER, STORAGE_OPTION_MARKER, SIGNATURE_MARKER]
    typed = next(iter(processes))  # the txflow process, watched first
    assert [(pid, m) for pid, line in command_lines.items() for m in markers if m in line] == [
        (typed, SIGNATURE_MARKER)]
    cluster = json.loads((first_state / "cluster.json").read_text())["processes"]
    roles = {p["pid"]: p["role"] + ("" if p["rank"] is None else str(p["rank"])) for p in cluster}
    roles.update({pid: "prefect" for pid, line in command_lines.items() if "prefect.server.api.server" in line})
    assert {"api", "coordinator0", "worker1", "prefect"} <= {roles.get(pid) for pid in processes}, processes
    roles[typed] = "txflow"
    # A process that one of these started and that has no role of its own (a helper it runs, or a child read
    # between its fork and its exec) inherits its parent's environment: it counts as its parent's role, which must
    # then hold no more than that role's credentials.
    while unassigned := [pid for pid in processes if pid not in roles and parents.get(pid) in roles]:
        for pid in unassigned:
            roles[pid] = roles[parents[pid]]
    held: dict[str, set] = {}
    for pid, (_, environment) in processes.items():
        held.setdefault(roles.get(pid, "other"), set()).update(m for m in markers[1:] if m in environment)
    held = {role: sorted(found) for role, found in held.items()}
    assert held.pop("txflow") == sorted(markers[1:4])  # as the user gave them (not vacuous)
    assert held["api"] == sorted([PASSWORD_MARKER, API_KEY_MARKER])
    assert held["coordinator0"] == [PASSWORD_MARKER]
    assert held["worker1"] == held["prefect"] == held.get("other", []) == [], (held, processes)
    assert report["dataset"] == f"s3://{BUCKET}/data/sft.jsonl?sig=***"
    for output in (first.stdout, first.stderr, second.stdout, second.stderr):
        assert [m for m in markers if m in output] == []
    for top in (first_state, second_state, Path(s3_env["PREFECT_HOME"])):
        files = [p for p in Path(top).rglob("*") if p.is_file()]
        found = [(p, m) for p in files for m in markers if m.encode() in p.read_bytes()]
        prefect_parameters = top == Path(s3_env["PREFECT_HOME"])  # the flow's parameters, checked below
        assert files and [(p, m) for p, m in found if not (prefect_parameters and m == SIGNATURE_MARKER and
                                                             p.name.startswith("prefect.db"))] == []
    with sqlite3.connect(Path(s3_env["PREFECT_HOME"]) / "prefect.db") as db:
        stored = json.dumps(db.execute("SELECT key, description, data FROM artifact").fetchall()
                            + db.execute("SELECT message FROM log").fetchall())
        parameters = json.dumps(db.execute("SELECT parameters FROM flow_run").fetchall())
    assert "report-" in stored and "sig=***" in stored and [m for m in markers if m in stored] == []
    assert SIGNATURE_MARKER in parameters  # where it is (above): the flow's parameters, as given
    for key in bucket_keys("runs/"):
        body = boto3.client("s3").get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert [m for m in markers if m.encode() in body] == [], key


def fake_state(staging: Path, model_id: str, name: str, files: int = 6) -> str:
    ckpt = staging / model_id / f"{name}.tar.gz" / "checkpoint_0"
    ckpt.mkdir(parents=True)
    for marker in ("_CHECKPOINT_METADATA", "_METADATA", "commit_success.txt"):
        (ckpt / marker).write_text("{}")
    for i in range(files):
        (ckpt / "ocdbt.process_0" / "d").mkdir(parents=True, exist_ok=True)
        (ckpt / "ocdbt.process_0" / "d" / f"part{i}").write_bytes(os.urandom(256 * 1024))
    return f"tinker://{model_id}/weights/{name}"


def test_s3_server_gone_during_commit_fails_with_a_clear_error_and_no_marker(tmp_path, moto, s3_env, monkeypatch):
    server, _ = moto
    proxy = TcpProxy(server.port)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # fail fast instead of botocore's retries
    cfg = RunConfig(base_model="tiny", run_id="fault", checkpoints=f"s3://{BUCKET}/faults",
                    state_dir=str(tmp_path / "state"),
                    storage_options={"endpoint_url": f"http://127.0.0.1:{proxy.port}"}).resolved()
    staging = tmp_path / "staging"
    path = fake_state(staging, "m1", "step-000002")
    import s3fs

    original = s3fs.S3FileSystem._put_file
    calls = []

    async def put_then_vanish(self, *args, **kwargs):
        result = await original(self, *args, **kwargs)
        calls.append(args)
        if len(calls) == 2:
            proxy.stop()  # the S3 server disappears in the middle of the upload
        return result

    s3fs.S3FileSystem._put_file = put_then_vanish
    try:
        with pytest.raises(OSError, match="no commit marker was written") as failure:
            storage.commit(cfg, str(staging), path)
    finally:
        s3fs.S3FileSystem._put_file = original
        proxy.stop()
    assert "s3://txflow-ckpt/faults/fault/m1/step-000002.tar.gz" in str(failure.value)
    # The server itself kept what arrived: part of the files, and no commit marker.
    keys = bucket_keys("faults/fault/")
    assert keys and "faults/fault/m1/step-000002.tar.gz" + COMMIT_SUFFIX not in keys
    found = discover(f"s3://{BUCKET}/faults/fault", require_commit=True)
    assert [(a.kind, a.complete, a.committed) for a in found] == [("state", False, False)]
    assert "no commit marker" in found[0].reason.lower()


def test_truncated_object_in_the_bucket_is_reported_incomplete(s3_env):
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for i in range(4):
            data = os.urandom(64 * 1024)
            info = tarfile.TarInfo(f"adapter{i}.safetensors")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    whole = buffer.getvalue()
    fs = fsspec.filesystem("s3")
    fs.pipe_file(f"{BUCKET}/trunc/m1/sampler_weights/ok.tar.gz", whole)
    fs.pipe_file(f"{BUCKET}/trunc/m1/sampler_weights/cut.tar.gz", whole[: len(whole) // 2])
    found = {a.path: a for a in discover(f"s3://{BUCKET}/trunc")}
    assert found["m1/sampler_weights/ok.tar.gz"].complete
    cut = found["m1/sampler_weights/cut.tar.gz"]
    assert not cut.complete and "truncated" in cut.reason.lower()


def run_root_layout(fs, root: str, staging: Path) -> dict[str, str]:
    """What a real run leaves: periodic and final states (one state file each), sampler tarballs with
    their probe markers, commit markers, and the run's own files; committed as txflow commits."""
    from txflow.checkpoints import storage

    cfg = RunConfig(base_model="tiny", run_id="layout", checkpoints=root.rsplit("/", 1)[0],
                    state_dir=str(staging)).resolved()
    urls = {}
    for step in (3, 6):
        name = f"step-{step:06d}"
        state = staging / "m1" / f"{name}.tar.gz"
        state.mkdir(parents=True)
        (state / STATE_FILE).write_bytes(os.urandom(200_000))
        urls[f"state-{step}"] = storage.commit(cfg, str(staging), f"tinker://m1/weights/{name}")
    sampler = staging / "m1" / "sampler_weights" / "step-000006.tar.gz"
    sampler.parent.mkdir(parents=True)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        data = os.urandom(100_000)
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    sampler.write_bytes(buffer.getvalue())
    (staging / "m1" / "sampler_weights" / "step-000006.tar.gz.probe").write_text("ok")
    urls["sampler"] = storage.commit(cfg, str(staging), "tinker://m1/step-000006")
    fs.pipe({f"{root.removeprefix('s3://')}/{name}": b"{}" for name in ("report.json", "metrics.jsonl")})
    return urls


def s3_requests(monkeypatch) -> list[str]:
    """The name of every S3 API operation sent from now on (paginated listings included)."""
    from aiobotocore.client import AioBaseClient

    sent: list[str] = []
    original = AioBaseClient._make_api_call

    async def counting(self, operation_name, api_params):
        sent.append(operation_name)
        return await original(self, operation_name, api_params)

    monkeypatch.setattr(AioBaseClient, "_make_api_call", counting)
    return sent


def test_a_committed_run_root_is_verified_from_the_listing_alone_and_a_changed_byte_is_caught(s3_env, monkeypatch,
                                                                                            tmp_path):
    """States, sampler tarballs, markers: discovery of what txflow committed sends list requests only;
    one byte flipped in the bucket (same size) makes that checkpoint incomplete, and only its marker is read."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    root = f"s3://{BUCKET}/layout/layout"
    urls = run_root_layout(fs, root, tmp_path)
    sent = s3_requests(monkeypatch)
    s3fs.S3FileSystem.clear_instance_cache()  # no listing cached from the commits above
    found = {a.url: a for a in discover(root, require_commit=True)}
    assert all(found[u].complete and found[u].committed for u in urls.values()), found
    assert sent and set(sent) == {"ListObjectsV2"}, sent

    state_key = f"{urls['state-6'].removeprefix('s3://')}/{STATE_FILE}"
    data = bytearray(fs.cat_file(state_key))
    data[1000] ^= 0xFF
    fs.pipe_file(state_key, bytes(data))
    sent.clear()
    s3fs.S3FileSystem.clear_instance_cache()
    found = {a.url: a for a in discover(root, require_commit=True)}
    damaged = found[urls["state-6"]]
    assert not damaged.complete and "the stored copy is not the committed one" in damaged.reason
    assert found[urls["state-3"]].committed and found[urls["sampler"]].committed
    assert [op for op in sent if op != "ListObjectsV2"] == ["GetObject"]  # that checkpoint's marker
    # A resume from it is refused before anything starts; the run root resolves to the intact step 3.
    cfg = RunConfig(base_model="tiny", run_id="again", checkpoints=f"s3://{BUCKET}/other",
                    resume_from=urls["state-6"]).resolved()
    with pytest.raises(ValueError, match="is incomplete"):
        storage.resolve_resume_from(cfg)
    assert storage.resolve_resume_from(cfg.model_copy(update={"resume_from": root})) == (urls["state-3"], 3)


def test_a_multipart_upload_is_committed_by_reading_it_back_and_a_changed_byte_is_caught(s3_env, monkeypatch, tmp_path):
    """A file above the single-part size goes up in parts; its ETag is then no MD5, so the commit reads the
    object back, the marker says so, and discovery hashes it rather than trusting the listing."""
    monkeypatch.setattr(storage, "SINGLE_PART_BYTES", 5 * 2**20)  # S3's smallest part: 12 MiB is 3 parts
    local = tmp_path / "step-000001"
    local.mkdir()
    big = bytearray(os.urandom(12 * 2**20))
    (local / STATE_FILE).write_bytes(big)
    (local / "small.json").write_text("{}")
    url = f"s3://{BUCKET}/multipart/run/m1/step-000001"
    storage.upload(local, url, {}, "a test state")

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    etag = fs.info(f"{url}/{STATE_FILE}")["ETag"].strip('"')
    assert etag.endswith("-3"), etag  # really multipart
    marker = json.loads(fs.cat_file(url + COMMIT_SUFFIX))
    assert marker["verify"] == "read"
    assert marker["files"][STATE_FILE]["md5"] == hashlib.md5(big).hexdigest()
    root = f"s3://{BUCKET}/multipart/run"
    sent = s3_requests(monkeypatch)
    s3fs.S3FileSystem.clear_instance_cache()
    [found] = [a for a in discover(root, require_commit=True) if a.kind == "state"]
    assert found.complete and found.committed, found
    assert "GetObject" in sent  # the marker and the parts' bytes were read, not the ETag believed

    big[len(big) // 2] ^= 0xFF  # the same size, uploaded in parts again: only reading it shows the change
    (local / STATE_FILE).write_bytes(big)
    fs.put_file(str(local / STATE_FILE), f"{url}/{STATE_FILE}", chunksize=5 * 2**20)
    s3fs.S3FileSystem.clear_instance_cache()
    [found] = [a for a in discover(root, require_commit=True) if a.kind == "state"]
    assert not found.complete and "the stored copy is not the committed one" in found.reason
    with pytest.raises(ValueError, match="is not the committed one"):
        storage.download(url, tmp_path / "back", {}, directory=True)


def test_an_upload_whose_stored_bytes_differ_is_not_committed(s3_env, monkeypatch, tmp_path):
    """The commit checks what the bucket holds, not what was sent: a multipart object changed between the
    upload and the marker (its size unchanged) leaves no marker."""
    monkeypatch.setattr(storage, "SINGLE_PART_BYTES", 5 * 2**20)
    local = tmp_path / "step-000002"
    local.mkdir()
    (local / STATE_FILE).write_bytes(os.urandom(11 * 2**20))
    url = f"s3://{BUCKET}/multipart/changed/m1/step-000002"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    from txflow.checkpoints import markers

    original = markers.write_commit

    def tamper_then_commit(fs_url, storage_options=None, expected=None):
        other = tmp_path / "other"
        other.write_bytes(os.urandom(11 * 2**20))
        fs.put_file(str(other), f"{url}/{STATE_FILE}", chunksize=5 * 2**20)
        return original(fs_url, storage_options, expected)

    monkeypatch.setattr(storage, "write_commit", tamper_then_commit)
    with pytest.raises(OSError, match="no commit marker"):
        storage.upload(local, url, {}, "a test state")
    assert not fs.exists(url + COMMIT_SUFFIX)


def test_a_key_a_bucket_writer_adds_under_a_committed_state_is_never_downloaded(tmp_path, s3_env, reaper,
                                                                               monkeypatch):
    """A key a bucket writer adds: after a run, one more key under its newest committed state, with `..`
    segments pointing out of the directory a resume downloads it to. Discovery calls that state incomplete and
    names the key, a resume from the run root takes the state before it, a resume from that state is refused
    before anything starts, and nothing is written where the key points. The runs sign their markers
    (TXFLOW_SIGNING_KEY): a signed run resumes, restores and checks as an unsigned one does."""
    first_state, second_state = reaper.watch(tmp_path / "s1"), reaper.watch(tmp_path / "s2")
    root = f"s3://{BUCKET}/writer"
    key = "signing-key-of-the-e2e-test-7d2f"
    monkeypatch.setenv(SIGNING_KEY_ENV, key)
    s3_env = s3_env | {SIGNING_KEY_ENV: key}
    run = ["run", "sft", "--base-model", "tiny", "--processes", "1", "--save-every", "2", "--no-export",
           "--checkpoints", root, "--json"]
    first = run_txflow([*run, "--run-id", "w-first", "--steps", "4", "--state-dir", str(first_state)], s3_env, tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    step4 = next(a["url"] for a in json.loads(first.stdout)["artifacts"]
                 if a["kind"] == "state" and a["path"].endswith("step-000004.tar.gz"))
    # A resume downloads a state to <state dir>/checkpoints/<model id>/<name>: 1 to 4 `..` reach from there
    # to this test's directory; every depth is tried.
    s3 = boto3.client("s3")
    prefix = step4.removeprefix(f"s3://{BUCKET}/")
    assert "hmac" in json.loads(s3.get_object(Bucket=BUCKET, Key=prefix + COMMIT_SUFFIX)["Body"].read())
    for depth in range(1, 5):
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{'../' * depth}PWNED-{depth}", Body=b"import os")
    added = f"'{'../' * 4}PWNED-4'"

    listed = run_txflow(["discover", f"{root}/w-first"], s3_env, tmp_path)
    assert listed.returncode == 1, listed.stdout
    [line] = [x for x in listed.stdout.splitlines() if x.startswith("state") and "step-000004.tar.gz " in x]
    assert "INCOMPLETE" in line and "is not recorded in the commit marker" in line, listed.stdout
    with pytest.raises(ValueError, match="is not recorded in its commit marker"):
        storage.download(step4, tmp_path / "s3" / "checkpoints" / "m" / "step-000004.tar.gz", {}, directory=True)

    began = time.monotonic()
    refused = run_txflow([*run, "--run-id", "w-refused", "--steps", "6", "--state-dir", str(tmp_path / "s3"),
                          "--resume-from", step4], s3_env, tmp_path)
    assert refused.returncode == 2 and time.monotonic() - began < 60, refused.stderr[-3000:]
    assert "is incomplete" in refused.stderr and added in refused.stderr
    assert not (tmp_path / "s3" / "cluster.json").exists()

    second = run_txflow([*run, "--run-id", "w-second", "--steps", "4", "--state-dir", str(second_state),
                         "--resume-from", f"{root}/w-first"], s3_env, tmp_path)
    assert second.returncode == 0, second.stderr[-4000:]
    assert json.loads(second.stdout)["resumed_from_step"] == 2  # the state before the changed one
    assert sorted(p.name for p in tmp_path.rglob("PWNED*")) == []

    # The attack: state names repeat across runs, and a signature that bound only the last name
    # let one run's checkpoint, copied with its marker over another's of the same name, be read as that run's.
    # w-second's step 4 replaces w-first's, byte for byte and marker included: a resume from it is refused
    # before anything starts, in one line naming both runs' paths.
    theirs = next(a["url"] for a in json.loads(second.stdout)["artifacts"]
                  if a["kind"] == "state" and a["path"].endswith("step-000004.tar.gz"))
    theirs_prefix = theirs.removeprefix(f"s3://{BUCKET}/")
    for listed in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]:
        s3.delete_object(Bucket=BUCKET, Key=listed["Key"])
    for listed in s3.list_objects_v2(Bucket=BUCKET, Prefix=theirs_prefix)["Contents"]:
        s3.copy_object(Bucket=BUCKET, Key=prefix + listed["Key"].removeprefix(theirs_prefix),
                       CopySource={"Bucket": BUCKET, "Key": listed["Key"]})
    copied = run_txflow([*run, "--run-id", "w-copied", "--steps", "6", "--state-dir", str(tmp_path / "s4"),
                         "--resume-from", step4], s3_env, tmp_path)
    assert copied.returncode == 2, copied.stderr[-3000:]
    [line] = [x for x in copied.stderr.splitlines() if "signed for" in x]
    assert f"signed for '{theirs_prefix.removeprefix('writer/')}'" in line and f"/{prefix}'" in line, line
    assert not (tmp_path / "s4" / "cluster.json").exists()


def test_a_second_run_with_a_live_runs_id_exits_2_before_starting_anything(tmp_path, s3_env, reaper):
    """One live run per run id: while a run holds its lease (created with S3's If-None-Match), a second
    `txflow run` with its --run-id, as a new run or with --resume-from, is refused in a few seconds, naming
    the live run, and starts nothing; the first passes."""
    first_state, second_state = reaper.watch(tmp_path / "s1"), reaper.watch(tmp_path / "s2")
    root = f"s3://{BUCKET}/leases"
    run = ["run", "sft", "--base-model", "tiny", "--processes", "1", "--steps", "4", "--no-export", "--checkpoints",
           root, "--run-id", "same"]
    with open(tmp_path / "first.out", "w") as out, open(tmp_path / "first.err", "w") as err:
        first = subprocess.Popen(txflow_cmd(*run, "--state-dir", str(first_state), "--json"), env=s3_env,
                                 cwd=tmp_path, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + 300
        while "leases/same/lease.json" not in bucket_keys("leases/same/"):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.err").read_text()[-3000:]
            time.sleep(0.5)
        for resume in ([], ["--resume-from", f"{root}/same"]):
            began = time.monotonic()
            second = run_txflow([*run, "--state-dir", str(second_state), *resume], s3_env, tmp_path, timeout=120)
            assert second.returncode == 2 and time.monotonic() - began < 60, second.stderr[-3000:]
            [line] = [x for x in second.stderr.splitlines() if x.startswith("txflow: ")]
            assert line.startswith(f"txflow: Run same is running under {root}/same (host ") and \
                "one live run per run id" in line, line
            assert not (second_state / "cluster.json").exists()
        assert first.wait(timeout=600) == 0, (tmp_path / "first.err").read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert json.loads((tmp_path / "first.out").read_text())["status"] == "passed"
    assert "leases/same/lease.json" not in bucket_keys("leases/same/")  # released at the end


def test_txflow_promoted_on_s3_refuses_a_pointer_a_record_or_an_adapter_not_signed_for_where_it_is(
        tmp_path, s3_env, monkeypatch):
    """The attack on a real S3 API, through the CLI that serving scripts call: with a signing
    key, `txflow promoted` shows the genuine promotion; a pointer aimed at another bucket, an unsigned pointer,
    and the previous promotion's adapter copied over the current one's each make it exit 2 in one line."""
    key = "signing-key-of-the-promotion-e2e-1c"
    monkeypatch.setenv(SIGNING_KEY_ENV, key)
    s3_env = s3_env | {SIGNING_KEY_ENV: key}
    root = f"s3://{BUCKET}/promoting"
    ids = []
    for run_id in ("one", "two"):
        local = tmp_path / run_id / "peft"
        local.mkdir(parents=True)
        (local / "adapter_config.json").write_text(json.dumps({"run": run_id}))
        (local / "adapter_model.safetensors").write_bytes(f"{run_id}-weights".encode())
        url = storage.upload(local, f"{root}/{run_id}/export/peft", {}, "an export",
                             signed_as=f"{run_id}/export/peft")
        ids.append(promotion_of(root, run_id, url).id)
        time.sleep(0.002)
    shown = run_txflow(["promoted", root, "prod"], s3_env, tmp_path)
    assert shown.returncode == 0 and "prod: run two" in shown.stdout, shown.stderr
    s3 = boto3.client("s3")
    pointer = "promoting/promoted/prod/current.json"
    good = s3.get_object(Bucket=BUCKET, Key=pointer)["Body"].read()

    def refused(expected: str) -> None:
        result = run_txflow(["promoted", root, "prod"], s3_env, tmp_path)
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert len([line for line in result.stderr.splitlines() if line.startswith("txflow:")]) == 1

    s3.put_object(Bucket=BUCKET, Key=pointer, Body=json.dumps(
        {**json.loads(good), "path": "../../../attacker/adapter"}).encode())
    refused("current.json: it is signed with another key, or was changed after it was signed")
    s3.put_object(Bucket=BUCKET, Key=pointer, Body=json.dumps(
        {"id": ids[1], "path": f"history/{ids[1]}", "run_id": "two", "promoted_at": 1}).encode())
    refused("current.json: it is not signed, and a signing key is set")
    s3.put_object(Bucket=BUCKET, Key=pointer, Body=good)
    ours, theirs = (f"promoting/promoted/prod/history/{i}/peft" for i in (ids[1], ids[0]))
    for name in ("adapter_config.json", "adapter_model.safetensors", ""):
        suffix = f"/{name}" if name else COMMIT_SUFFIX
        s3.copy_object(Bucket=BUCKET, Key=ours + suffix, CopySource={"Bucket": BUCKET, "Key": theirs + suffix})
    refused(f"signed for 'promoted/prod/history/{ids[0]}/peft', not for where it is stored")


def promotion_of(root: str, run_id: str, url: str):
    from txflow.checkpoints import promotion

    return promotion.promote(root, "prod", run_id, {"peft": url}, {"mode": "sft", "base_model": "tiny",
                                                                  "figures": {}})
