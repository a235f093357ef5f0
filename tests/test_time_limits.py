"""tests/time_limits.py: a run in which a test took more than 1/1.5 of its time limit fails, and every run names
the test closest to its limit."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["pytester"]

TESTS = """
import time
import pytest

@pytest.mark.timeout({limit})
def test_sleeps():
    time.sleep(0.6)

def test_quick():
    pass
"""


@pytest.mark.parametrize(("limit", "fails"), [(0.8, True), (1.5, False)])
def test_a_test_near_its_time_limit_fails_the_run(pytester, monkeypatch, limit, fails):
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeini("[pytest]\ntimeout = 60\n")
    pytester.makepyfile(TESTS.format(limit=limit))
    result = pytester.runpytest_subprocess("-p", "tests.time_limits")
    result.stdout.fnmatch_lines(["closest to its time limit: test_a_test_near_its_time_limit_fails_the_run.py"
                                 "::test_sleeps, 1 s of *"])
    assert result.ret == (1 if fails else 0)
    assert ("FAILED (time limit)" in result.stdout.str()) == fails
    result.assert_outcomes(passed=2)  # the tests themselves passed
