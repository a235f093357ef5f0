"""The progress artifact's sender (txflow.reporting.bar): updates coalesce, at most one a second, and the
last value always arrives when the bar closes."""

from __future__ import annotations

import time

import prefect.artifacts
import prefect.context
import pytest

from txflow.reporting import bar as progress

pytestmark = [pytest.mark.timed]


def test_updates_coalesce_and_the_last_one_arrives_at_close(monkeypatch):
    sent: list[tuple[float, float]] = []
    monkeypatch.setattr(prefect.context.TaskRunContext, "get", classmethod(lambda cls: object()))
    monkeypatch.setattr(prefect.artifacts, "create_progress_artifact", lambda **kwargs: "artifact-id")
    monkeypatch.setattr(prefect.artifacts, "update_progress_artifact",
                        lambda artifact_id, progress: sent.append((time.monotonic(), progress)))
    bar = progress.TrainingBar(total=40, initial=0, run_id="coalesce")
    for done in range(1, 41):  # 40 steps in about 0.4 s
        bar.update(done)
        time.sleep(0.01)
    closing = time.monotonic()
    bar.close()
    assert time.monotonic() - closing < progress.MIN_INTERVAL_S / 2  # close does not wait out the interval
    assert sent[-1][1] == 100.0  # and the last value arrives
    # One send when the first step lands, then nothing until the interval has passed or the bar closes.
    assert len(sent) <= 2, sent
