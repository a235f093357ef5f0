"""Two runs never hold the same cluster slots: the guard against a real Prefect API, and what happens when
its limit is missing there."""

from __future__ import annotations

import logging
import threading

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.testing.utilities import prefect_test_harness

from flows import train as train_module
from flows.train import cluster_slots
from txflow.config import RunConfig
from txflow.preflight import PreflightError

pytestmark = [pytest.mark.together]


@pytest.fixture(scope="module")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_runs_that_need_every_slot_take_turns(prefect_api):
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="test-cluster-slots", limit=2))
    cfg = RunConfig(processes=2, concurrency_limit="test-cluster-slots")
    first_in, release, second_in = threading.Event(), threading.Event(), threading.Event()

    def first():
        with cluster_slots(cfg):
            first_in.set()
            release.wait(60)  # holds its slots until the test has seen the second run wait

    def second():
        first_in.wait(60)
        with cluster_slots(cfg):
            second_in.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    try:
        assert first_in.wait(60)
        assert not second_in.wait(3)  # the first holds every slot: the second waits, however long it takes
        release.set()
        assert second_in.wait(60)  # and gets them once they are free
    finally:
        release.set()
        for t in threads:
            t.join(timeout=120)


def test_a_limit_named_on_purpose_that_the_server_lacks_stops_the_run(prefect_api):
    cfg = RunConfig(processes=2, concurrency_limit="tx-cluster-slotz")
    with pytest.raises(PreflightError, match="--concurrency-limit tx-cluster-slotz: the Prefect server has no global "
                                             "concurrency limit of that name, so it would guard nothing. Create it: "
                                             "prefect gcl create tx-cluster-slotz --limit N"):
        with cluster_slots(cfg):
            pytest.fail("the guard let a run in without its limit")


def test_the_default_limit_missing_is_said_once_with_the_command_that_creates_it(prefect_api, caplog, monkeypatch):
    monkeypatch.setattr(train_module, "_warned", set())
    cfg = RunConfig(processes=2)
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        with cluster_slots(cfg):
            pass
    said = [r.getMessage() for r in caplog.records if "concurrency limit" in r.getMessage()]
    assert len(said) == 1 and "prefect gcl create txflow-cluster-slots --limit N" in said[0], said
