"""The demo benchmark's output (scripts/bench_demo.py), on synthetic runs: every program's compile seconds, each
process's peak, the cold and warm figures against their targets. No timing here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_demo.py"


@pytest.fixture
def bench():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("bench_demo", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(SCRIPT.parent))


def run(name: str, wall: float, compiles: dict, status: str = "passed") -> dict:
    timings = {"launch-workers": 12.0, "train": 60.0, **{f"compile {k}": v for k, v in compiles.items()},
               "total": wall - 6}
    return {"name": name, "wall": wall, "rss": {"rank 0 (engine)": 5400.0, "api": 300.0},
            "cpu": {"rank 0 (engine)": 210.0, "api": 4.0},
            "report": {"status": status, "timings_s": timings, "restore": {"passed": status == "passed"},
                       "export": {"passed": True}}}


def test_the_summary_names_each_program_compile_each_process_and_the_targets(bench):
    text = bench.summary(run("cold", 182.0, {"sample 64": 17.6, "train 64": 9.1, "optimizer": 10.0}),
                         run("warm", 126.0, {"sample 64": 5.3, "train 64": 1.4, "optimizer": 3.4}))
    assert "## cold: 182.0 s, passed (restore check passed, export proven)" in text
    assert "- compiles (s): sample 64 17.6, train 64 9.1, optimizer 10.0" in text
    assert "- steps (s): launch-workers 12.0, train 60.0" in text  # the compiles and the total apart
    assert "rank 0 (engine) 5400 / 210" in text and "api 300 / 4" in text
    assert ("cold demo 182.0 s (target <= 240 s: met); warm demo 126.0 s (target <= 90 s: NOT met); warm / cold "
            "0.692; every check passed: True") in text
    assert "slowest compile in the cold run: sample 64 17.6 s (target <= 15 s a program: NOT met)" in text
    text = bench.summary(run("cold", 182.0, {"sample 64": 11.6, "train 64": 9.1}), run("warm", 126.0, {}))
    assert "slowest compile in the cold run: sample 64 11.6 s (target <= 15 s a program: met)" in text


def test_a_failed_run_is_said_so(bench):
    text = bench.summary(run("cold", 300.0, {}, status="failed"), run("warm", 80.0, {}))
    assert "## cold: 300.0 s, failed (restore check FAILED" in text and "compiles (s): none logged" in text
    assert "slowest compile" not in text
    assert "target <= 240 s: NOT met" in text and "target <= 90 s: met" in text
    assert "every check passed: False" in text
