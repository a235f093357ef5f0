"""The flow-versus-by-hand benchmark's output (scripts/bench_flow.py), on synthetic measurements:
its format, and that it refuses to compare sides that did not run the same job (a different number of
steps, or different losses). No timing here."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_flow.py"


@pytest.fixture
def bench():
    spec = importlib.util.spec_from_file_location("bench_flow", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def side(wall: float, steps: int, step_s: float, rss: dict, cpu: dict | None = None, nudge: float = 0.0) -> dict:
    return {"wall": wall, "outside": 1.0, "cluster_up": 20.0, "train": steps * step_s, "save_restore": 10.0,
            "teardown": 0.2, "steps": steps, "step_seconds": [7.0] + [step_s] * (steps - 1), "rss": rss,
            "cpu": cpu or {}, "restore_passed": True, "sample_batches": {},
            "losses": [3.0 - 0.1 * i + nudge for i in range(steps)]}


def run_main(bench, monkeypatch, tmp_path, hand, flow):
    monkeypatch.setattr(bench, "by_hand", lambda steps, env, work: hand(steps))
    monkeypatch.setattr(bench, "flow", lambda steps, env, work, run_id: flow(steps))
    monkeypatch.setattr(bench, "resolve_base_model", lambda name: str(tmp_path))
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: None)
    monkeypatch.setattr(sys, "argv", ["bench_flow.py", "--steps", "20", "--long-steps", "0", "--cache", "off",
                                      "--repeat", "1"])
    made = []

    def mkdtemp(prefix):
        made.append(tmp_path / f"{prefix}work")
        made[-1].mkdir()
        return str(made[-1])

    monkeypatch.setattr(bench.tempfile, "mkdtemp", mkdtemp)
    try:
        return bench.main()
    finally:
        # the work directory (Prefect's home, the runs, the JAX cache) is removed, also when a check failed
        assert len(made) == 1 and not made[0].exists()


def test_the_table_reports_phases_ratio_step_overhead_and_memory(bench):
    hand = side(50.0, 20, 0.30, {"driver (txflow / script)": 350, "rank 0 (engine)": 1300},
                {"driver (txflow / script)": 2.0, "rank 0 (engine)": 40.0})
    flow = side(54.0, 20, 0.306, {"driver (txflow / script)": 370, "rank 0 (engine)": 1310, "prefect server": 200},
                {"driver (txflow / script)": 6.5, "rank 0 (engine)": 41.0, "prefect server": 5.25})
    text = bench.table("compilation cache off, 20 steps", hand, flow)
    assert text.startswith("## compilation cache off, 20 steps")
    for phase in ("whole process", "outside the flow", "cluster up", "train steps", "save + restore + checks",
                  "teardown"):
        assert re.search(rf"\| {re.escape(phase)}[^|]* \| [\d.]+ \| [\d.]+ \|", text), phase
    assert "steps: by hand 20, flow 20" in text
    assert "whole-process ratio: 1.080 (target <= 1.05)" in text
    assert "median train step: by hand 0.300 s, flow 0.306 s, overhead +2.0% (target <= 3%)" in text
    assert "- prefect server: by hand 0, flow 200" in text
    assert "- total: by hand 1650, flow 1880, flow adds 230 MiB (target <= 300)" in text
    assert "- prefect server: by hand 0.0, flow 5.2" in text
    assert "- total: by hand 42.0, flow 52.8" in text


def test_sides_with_different_step_counts_are_not_compared(bench, monkeypatch, tmp_path, capsys):
    with pytest.raises(AssertionError):
        run_main(bench, monkeypatch, tmp_path, lambda steps: side(50.0, steps, 0.3, {}),
                 lambda steps: side(55.0, steps - 1, 0.3, {}))
    assert "whole-process ratio" not in capsys.readouterr().out


def test_sides_whose_losses_differ_did_not_run_the_same_job(bench, monkeypatch, tmp_path, capsys):
    with pytest.raises(AssertionError, match="not the same job: per-step losses differ by up to 0.1"):
        run_main(bench, monkeypatch, tmp_path, lambda steps: side(50.0, steps, 0.3, {}),
                 lambda steps: side(55.0, steps, 0.3, {}, nudge=0.1))
    assert "whole-process ratio" not in capsys.readouterr().out


def test_sides_that_ran_the_same_job_are_compared_and_say_so(bench, monkeypatch, tmp_path, capsys):
    assert run_main(bench, monkeypatch, tmp_path, lambda steps: side(50.0, steps, 0.3, {}),
                    lambda steps: side(55.0, steps, 0.3, {}, nudge=2e-6)) == 0
    out = capsys.readouterr().out
    assert "steps: by hand 20, flow 20" in out and "whole-process ratio: 1.100" in out
    assert "same job: every step's loss agrees between the sides within 2.0e-06 (limit 2e-02)" in out


def test_repeated_pairs_report_the_median_ratio_and_pool_their_steps(bench):
    hands = [side(50.0, 20, 0.30, {"api": 200}, {"api": 3.0}), side(52.0, 20, 0.50, {"api": 210}, {"api": 4.0}),
             side(51.0, 20, 0.30, {"api": 220}, {"api": 5.0})]
    flows = [side(55.0, 20, 0.30, {"api": 200}), side(54.6, 20, 0.30, {"api": 200}),
             side(60.0, 20, 0.50, {"api": 200})]
    hand, flow = bench.combine(hands), bench.combine(flows)
    assert (hand["wall"], hand["rss"], hand["cpu"]) == (51.0, {"api": 210}, {"api": 4.0})
    assert len(hand["steady"]) == 3 * 19 and bench.median_step(hand) == 0.30
    text = bench.table("x", hand, flow, [f["wall"] / h["wall"] for h, f in zip(hands, flows)])
    assert "whole-process ratio: 1.100 (target <= 1.05)" in text  # the middle of 1.100, 1.050, 1.176
    assert "ratio of each pair (median above): 1.100, 1.050, 1.176" in text
    assert "mean train step: by hand 0.367 s, flow 0.367 s, overhead +0.0%" in text
