"""The typed run report: a report.json written before `RunReport` existed reads, renders and writes back
unchanged (but for the one key of a removed compatibility path), and a new report has the same keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.launch_workers import launch_workers
from tasks.provision_coordinator import provision_coordinator
from tasks.train import train
from txflow.config import RunConfig
from txflow.reporting import report as run_report
from txflow.reporting.report import RunReport
from txflow.results import Progress, step_name

# `txflow run sft --steps 3 --save-every 1 --keep-last 1 --promote-as prod --processes 1 --json` at e0e6a56,
# the commit before `RunReport`, with its temporary directory renamed /runs.
BEFORE = Path(__file__).parent / "data" / "report-0e6a56.json"
# Read only by a path that could not happen any more (a run root without the live model's record).
DROPPED = {"live_reference_from_committed_state"}


@pytest.fixture
def before() -> dict:
    return json.loads(BEFORE.read_text())


def test_a_report_written_before_reads_and_writes_back_unchanged(before):
    report = RunReport.read(BEFORE.read_text())
    assert report.passed and report.run_id == "orig-report" and len(report.metrics) == 3
    assert report.export.passed and report.promotion.status == "promoted"
    assert [a.kind for a in report.artifacts].count("export") == 1
    again = json.loads(report.to_json())
    # Every key and value of the old report is there, unchanged (new keys may be added, empty).
    assert unchanged(again, {k: v for k, v in before.items() if k not in DROPPED}) == []


def test_a_new_report_has_the_same_keys(before, tmp_path):
    cfg = RunConfig(run_id="keys", state_dir=str(tmp_path / "state"), checkpoints=str(tmp_path / "ckpt")).resolved()
    report = run_report.build(cfg, Progress(), "RuntimeError: the cluster never came up")
    assert set(json.loads(report.to_json())) >= set(before) - DROPPED
    assert report.status == "failed" and not report.passed


def unchanged(new, old, where: str = "report") -> list[str]:
    """Where `new` lost or changed something `old` had (dicts may have gained keys)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [p for key, value in old.items()
                for p in (unchanged(new[key], value, f"{where}.{key}") if key in new else [f"{where}.{key} lost"])]
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [p for i, (n, o) in enumerate(zip(new, old)) for p in unchanged(n, o, f"{where}[{i}]")]
    return [] if new == old else [f"{where}: {old!r} -> {new!r}"]


def test_step_timings_are_read_by_the_steps_themselves(before):
    report = RunReport.read(BEFORE.read_text())
    timings = before["timings_s"]
    assert report.seconds(provision_coordinator, launch_workers) == pytest.approx(
        timings["provision-coordinator"] + timings["launch-workers"])
    assert report.seconds(train) == timings["train"] and report.seconds("no-such-step") == 0


def test_the_markdown_of_a_report_names_its_checks_and_steps():
    text = run_report.markdown(RunReport.read(BEFORE.read_text()))
    assert text.startswith("# txflow run `orig-report`: passed")
    assert "- restore check: **passed**" in text and "## Exported adapter" in text and "promoted as **prod**" in text
    assert "- launch-workers: " in text


def test_progress_times_a_step_under_its_name_and_remembers_the_current_one():
    def approval(value):  # a plain function: its name with dashes
        return value

    progress = Progress()
    assert progress.run(approval, 1) == 1
    with pytest.raises(ZeroDivisionError):
        progress.time(lambda: 1 / 0)  # timed even when it fails, and not the current step
    assert progress.step == "approval" and set(progress.timings) == {"approval", "<lambda>"}
    assert step_name(train) == "train" == train.name  # a Prefect task: its own name


def test_the_answers_before_and_after_training_are_shown_with_their_accuracy():
    report = RunReport.read(BEFORE.read_text())
    assert run_report.answers_text(report) == [] and "## Answers" not in run_report.markdown(report)
    report.restore |= {"answers": [{"prompt": "What is 12 + 7?", "expected": "19", "base": "9", "trained": "19"}],
                       "base_accuracy": 0.25, "accuracy": 0.75}
    text = run_report.markdown(report)
    assert "Held-out accuracy: **25%** base model, **75%** trained" in text
    assert "| What is 12 + 7? | 19 | 9 | 19 |" in text
    assert run_report.answers_text(report) == ["  'What is 12 + 7?' (expected 19): base model '9', trained '19'",
                                               "  held-out accuracy: 25% base model -> 75% trained"]


def test_the_harness_scores_show_the_base_model_and_the_adapter_side_by_side():
    report = RunReport.read(BEFORE.read_text())
    assert report.evaluation is None and "scored by" not in run_report.markdown(report)  # older reports read
    report.evaluation = {"task": "arithmetic", "harness": "inspect_ai",
                         "scores": [{"model": "smollm2-135m", "accuracy": 0.25, "samples": 24, "log": "a.json"},
                                    {"model": "mine", "accuracy": 0.5, "samples": 24, "log": "b.json"}]}
    text = run_report.markdown(report)
    assert "## arithmetic, scored by inspect_ai" in text
    assert "| `smollm2-135m` | 25.0% | 24 |\n| `mine` | 50.0% | 24 |" in text


def test_the_report_scrubs_the_dataset_and_every_url(tmp_path):
    from txflow.log import register_run_secrets

    cfg = RunConfig(run_id="signed", state_dir=str(tmp_path / "state"), checkpoints=str(tmp_path / "ckpt"),
                    dataset="https://acct.blob.core.windows.net/c/sft.jsonl?sv=1&sig=SigMarker42").resolved()
    register_run_secrets(cfg)
    report = run_report.build(cfg, Progress(), f"OSError: cannot read {cfg.dataset}")
    text = report.to_json()
    assert "SigMarker42" not in text
    assert report.dataset == "https://acct.blob.core.windows.net/c/sft.jsonl?sv=1&sig=***"
    assert report.error == "OSError: cannot read https://acct.blob.core.windows.net/c/sft.jsonl?sv=1&sig=***"
    assert report.num_processes == cfg.processes and report.metrics == []  # the rest as built
