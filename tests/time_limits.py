"""Every test finishes well within its time limit (pytest-timeout's `timeout` mark, else the ini's): one that took
more than 1 / TIMEOUT_MARGIN of it passes on this machine and times out on a slower one. The run ends with the
test closest to its limit, and fails if any came within the margin (a plugin of tests/conftest.py)."""

from __future__ import annotations

import pytest

TIMEOUT_MARGIN = 1.5


def time_limit_s(item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        return float(marker.args[0] if marker.args else marker.kwargs["timeout"])
    return float(item.config.getini("timeout") or 0)  # 0: no limit


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    report.user_properties.append(("time_limit_s", time_limit_s(item)))  # read by the controller (xdist)


class TimeLimits:
    """How much of its time limit each test took, its setup, call and teardown together (as pytest-timeout counts)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.limits: dict[str, float] = {}

    def pytest_runtest_logreport(self, report) -> None:
        limit = dict(report.user_properties).get("time_limit_s")
        if limit:
            self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
            self.limits[report.nodeid] = limit

    def share(self, nodeid: str) -> float:
        return self.seconds[nodeid] / self.limits[nodeid]

    def too_close(self) -> list[str]:
        return [nodeid for nodeid in self.seconds if self.share(nodeid) * TIMEOUT_MARGIN > 1]

    def pytest_sessionfinish(self, session) -> None:
        if self.too_close() and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.seconds:
            return
        closest = max(self.seconds, key=self.share)
        terminalreporter.write_line(f"closest to its time limit: {closest}, {self.seconds[closest]:.0f} s of "
                                    f"{self.limits[closest]:.0f} s ({self.share(closest):.0%})")
        for nodeid in self.too_close():
            terminalreporter.write_line(f"FAILED (time limit): {nodeid} took {self.seconds[nodeid]:.0f} s of its "
                                        f"{self.limits[nodeid]:.0f} s, more than 1/{TIMEOUT_MARGIN} of it", red=True)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) sees every report
        config.pluginmanager.register(TimeLimits(), "txflow-time-limits")
