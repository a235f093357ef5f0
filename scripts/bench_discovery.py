"""Benchmark: discovery on an S3 store versus a bare recursive listing.

Creates N objects under a root on an S3 API (a moto_server it starts on
127.0.0.1, or the one AWS_ENDPOINT_URL names), laid out like a run root with
many Orbax checkpoints (upstream's many-file state layout, the harder case
for the classifier; txflow's own state is one file), then times, in the same run and on the same store,
`fs.find(root, detail=True)` (the baseline) and `txflow.discovery.discover(root)`
(classification included). Prints both and their ratio; the target is <= 1.5.

    python scripts/bench_discovery.py [--objects 10000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from txflow.discovery import COMMIT_SUFFIX, commit_record, discover

FILES_PER_CHECKPOINT = 48


def layout(objects: int) -> dict[str, bytes]:
    """Run-root-like keys: Orbax state directories of FILES_PER_CHECKPOINT files, plus commit markers."""
    keys: dict[str, bytes] = {}
    for step in range(1, objects // (FILES_PER_CHECKPOINT + 1) + 1):
        ckpt = f"model_bench/step-{step:06d}.tar.gz"
        names = ["checkpoint_0/_CHECKPOINT_METADATA", "checkpoint_0/_METADATA", "checkpoint_0/commit_success.txt",
                 "checkpoint_0/manifest.ocdbt"]
        names += [f"checkpoint_0/ocdbt.process_0/d/{i:04x}" for i in range(FILES_PER_CHECKPOINT - len(names))]
        for name in names:
            keys[f"{ckpt}/{name}"] = b"x" * 16
        keys[f"{ckpt}{COMMIT_SUFFIX}"] = commit_record({n: 16 for n in names})
    for i in range(objects - len(keys)):
        keys[f"logs/extra-{i:05d}.txt"] = b"x"
    return keys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import fsspec

    from txflow.processes import free_port, port_open, spawn, stop_groups

    server = None
    if not os.environ.get("AWS_ENDPOINT_URL"):
        port = free_port()
        log = Path(tempfile.mkdtemp()) / "moto.log"
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
        fs.pipe({f"{root}/{k}": v for k, v in layout(args.objects).items()})
        print(f"created {args.objects} objects in {time.monotonic() - started:.1f} s", file=sys.stderr)

        baseline, classify = [], []
        for _ in range(args.repeats):
            fresh = fsspec.filesystem("s3", skip_instance_cache=True)
            t0 = time.perf_counter()
            listed = fresh.find(root, detail=True)
            baseline.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            artifacts = discover(f"s3://{root}", require_commit=True)
            classify.append(time.perf_counter() - t0)
        assert len(listed) == args.objects, len(listed)
        assert all(a.complete for a in artifacts), [a for a in artifacts if not a.complete][:1]
        assert all(a.committed for a in artifacts if a.kind == "state"), "a commit marker was not verified"
        find_s, discover_s = statistics.median(baseline), statistics.median(classify)
        print(f"objects {args.objects}  artifacts {len(artifacts)}  find {find_s:.3f} s  "
              f"discover {discover_s:.3f} s  ratio {discover_s / find_s:.2f} (target <= 1.5)")
    finally:
        if server is not None:
            stop_groups([server.pid], grace_s=3.0)
            server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
