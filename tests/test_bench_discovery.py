"""The discovery benchmark runs end to end against its own S3 server (no timing asserted here:
the ratio it prints is the measurement, see README)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_discovery.py"


@pytest.mark.e2e
def test_benchmark_prints_the_ratio_of_discovery_to_a_bare_listing(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("AWS_")}
    result = subprocess.run([sys.executable, str(SCRIPT), "--objects", "300", "--repeats", "1"], env=env,
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"objects 300\s+artifacts (\d+)\s+find [\d.]+ s\s+discover [\d.]+ s\s+ratio ([\d.]+)",
                      result.stdout)
    assert match and int(match.group(1)) == 12 and float(match.group(2)) > 0
