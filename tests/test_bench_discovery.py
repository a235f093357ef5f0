"""The discovery benchmark runs end to end against its own S3 server, on a real run root's layout.
Timing is the benchmark's business (docs/performance.md); here only a loose bound, so noise cannot flake it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_discovery.py"


@pytest.mark.e2e
def test_benchmark_prints_the_ratio_and_no_request_beyond_the_listing(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AWS_")}
    result = subprocess.run([sys.executable, str(SCRIPT), "--objects", "600", "--repeats", "3"], env=env,
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"objects (\d+)\s+artifacts (\d+)\s+checkpoints (\d+)\s+find [\d.]+ s\s+discover [\d.]+ s\s+"
                      r"ratio ([\d.]+) .*requests beyond the listing per checkpoint ([\d.]+)", result.stdout)
    assert match, result.stdout
    objects, artifacts, checkpoints, ratio, requests = match.groups()
    # report.json and metrics.jsonl are artifacts too; manifest.json is the listing, never listed.
    assert int(objects) == 598 and int(checkpoints) == 2 * 119 and int(artifacts) == 238 + 2
    assert float(requests) == 0.0
    assert 0 < float(ratio) < 3.0, result.stdout
