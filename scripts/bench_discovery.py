"""Benchmark: discovery on an S3 store versus a bare recursive listing.

Creates N objects under a root on an S3 API (a moto_server it starts on
127.0.0.1, or the one AWS_ENDPOINT_URL names), laid out as a real run root
leaves them: periodic and final training states (txflow's one state file),
sampler tarballs (real gzip tarballs) with their `.probe` markers, a commit
marker per checkpoint as `storage.commit` writes it (sizes and MD5s), and the
run's own files. Then times, in the same run and on the same store,
`fs.find(root, detail=True)` (the baseline) and `txflow.checkpoints.discovery.discover(root)`
(classification and verification included), and counts the S3 requests
discovery sends. Prints both times, their ratio (target <= 1.5) and the
requests per checkpoint.

    python scripts/bench_discovery.py [--objects 10000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import atexit
import io
import os
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from txflow.checkpoints.discovery import discover
from txflow.checkpoints.markers import COMMIT_SUFFIX, commit_record, md5_of
from txflow.upstream.skyrl_tx.layout import STATE_FILE

OBJECTS_PER_STEP = 5  # state file + marker, sampler tarball + probe + marker


def _tarball(payload: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


def layout(objects: int) -> tuple[dict[str, bytes], int]:
    """Run-root keys as a run with a save at every step leaves them; returns them and the checkpoint count."""
    keys: dict[str, bytes] = {}
    steps = max(1, (objects - 3) // OBJECTS_PER_STEP)
    for step in range(1, steps + 1):
        state = f"model_bench/step-{step:06d}.tar.gz"
        data = os.urandom(64)
        keys[f"{state}/{STATE_FILE}"] = data
        keys[state + COMMIT_SUFFIX] = commit_record({STATE_FILE: (len(data), md5_of(data))})
        sampler = f"model_bench/sampler_weights/step-{step:06d}.tar.gz"
        blob = _tarball(os.urandom(64))
        keys[sampler] = blob
        keys[sampler + ".probe"] = b"ok"
        keys[sampler + COMMIT_SUFFIX] = commit_record({sampler.rsplit("/", 1)[1]: (len(blob), md5_of(blob))})
    for name in ("report.json", "metrics.jsonl", "manifest.json")[: max(0, objects - len(keys))]:
        keys[name] = b"{}"
    return keys, 2 * steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import fsspec
    import s3fs

    from txflow.processes.groups import spawn, stop_groups
    from txflow.processes.ports import free_port, port_open

    server = None
    if not os.environ.get("AWS_ENDPOINT_URL"):
        port = free_port()
        logs = tempfile.mkdtemp(prefix="bench-discovery-")
        atexit.register(shutil.rmtree, logs, ignore_errors=True)
        log = Path(logs) / "moto.log"
        server = spawn([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], log)
        os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                          AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        deadline = time.monotonic() + 30
        while not port_open("127.0.0.1", port):
            if time.monotonic() > deadline:
                raise SystemExit(f"moto_server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
    try:
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        bucket, root = "txflow-bench", "txflow-bench/run"
        fs.mkdir(bucket)
        started = time.monotonic()
        keys, checkpoints = layout(args.objects)
        fs.pipe({f"{root}/{k}": v for k, v in keys.items()})
        print(f"created {len(keys)} objects in {time.monotonic() - started:.1f} s", file=sys.stderr)

        from aiobotocore.client import AioBaseClient

        sent: list[str] = []
        original = AioBaseClient._make_api_call

        async def counting(self, operation_name, api_params):
            sent.append(operation_name)
            return await original(self, operation_name, api_params)

        baseline, classify, requests = [], [], []
        for _ in range(args.repeats):
            fresh = fsspec.filesystem("s3", skip_instance_cache=True)
            t0 = time.perf_counter()
            listed = fresh.find(root, detail=True)
            baseline.append(time.perf_counter() - t0)
            s3fs.S3FileSystem.clear_instance_cache()
            sent.clear()
            AioBaseClient._make_api_call = counting
            try:
                t0 = time.perf_counter()
                artifacts = discover(f"s3://{root}", require_commit=True)
                classify.append(time.perf_counter() - t0)
            finally:
                AioBaseClient._make_api_call = original
            requests.append(len([op for op in sent if op != "ListObjectsV2"]))
        assert len(listed) == len(keys), len(listed)
        assert all(a.complete for a in artifacts), [a for a in artifacts if not a.complete][:1]
        assert sum(a.committed for a in artifacts) == checkpoints, "a commit marker was not verified"
        find_s, discover_s = statistics.median(baseline), statistics.median(classify)
        print(f"objects {len(keys)}  artifacts {len(artifacts)}  checkpoints {checkpoints}  find {find_s:.3f} s  "
              f"discover {discover_s:.3f} s  ratio {discover_s / find_s:.2f} (target <= 1.5)  "
              f"requests beyond the listing per checkpoint {max(requests) / checkpoints:.3f}")
    finally:
        if server is not None:
            stop_groups([server.pid], grace_s=3.0)
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
