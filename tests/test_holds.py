"""Hold points (txflow.processes.holds): off unless TXFLOW_HOLD_AT names them; then held until released."""

from __future__ import annotations

import threading

import pytest

from txflow.processes.holds import hold_point


@pytest.fixture
def holds(tmp_path, monkeypatch):
    monkeypatch.setenv("TXFLOW_HOLD_DIR", str(tmp_path))
    return tmp_path


def test_a_point_not_named_writes_nothing_and_does_not_wait(holds, monkeypatch):
    monkeypatch.setenv("TXFLOW_HOLD_AT", "evaluate-restore,train-step-6")
    # Without a release, a wait would end in TimeoutError: returning means it did not wait.
    hold_point("save-checkpoint", timeout_s=0.1)
    hold_point("train-step-60", timeout_s=0.1)
    monkeypatch.delenv("TXFLOW_HOLD_AT")
    hold_point("evaluate-restore", timeout_s=0.1)
    assert list(holds.iterdir()) == []


def test_a_named_point_is_held_until_released_and_a_release_stays(holds, monkeypatch):
    monkeypatch.setenv("TXFLOW_HOLD_AT", "train-step-6,save-checkpoint")
    errors = []
    holder = threading.Thread(target=lambda: _capture(errors, hold_point, "save-checkpoint", timeout_s=60))
    holder.start()
    try:
        held = holds / "save-checkpoint.held"
        for _ in range(400):
            if held.exists():
                break
            holder.join(0.05)
        assert held.exists()
        holder.join(0.5)
        assert holder.is_alive()  # still held: no release yet
    finally:
        (holds / "save-checkpoint.release").touch()
        holder.join(10)
    assert not holder.is_alive() and errors == []
    hold_point("save-checkpoint", timeout_s=0.1)  # a retry passes the released point at once


def test_a_forgotten_release_ends_in_a_timeout_naming_the_file(holds, monkeypatch):
    monkeypatch.setenv("TXFLOW_HOLD_AT", "evaluate-restore")
    with pytest.raises(TimeoutError, match=r"hold point evaluate-restore: no .*evaluate-restore\.release within"):
        hold_point("evaluate-restore", timeout_s=0.2)
    assert (holds / "evaluate-restore.held").exists()


def _capture(errors: list, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except BaseException as exc:
        errors.append(exc)
