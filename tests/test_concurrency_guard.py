"""Two runs never hold the same cluster slots: the guard against a real Prefect API."""

from __future__ import annotations

import threading
import time

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.testing.utilities import prefect_test_harness

from flows.train import cluster_slots
from txflow.config import RunConfig


@pytest.fixture(scope="module")
def prefect_api():
    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_runs_that_need_every_slot_take_turns(prefect_api):
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name="test-cluster-slots", limit=2))
    cfg = RunConfig(processes=2, concurrency_limit="test-cluster-slots")
    held: list[tuple[float, float]] = []

    def run():
        with cluster_slots(cfg):
            began = time.monotonic()
            time.sleep(1.5)
            held.append((began, time.monotonic()))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(held) == 2
    (a_start, a_end), (b_start, b_end) = sorted(held)
    assert b_start >= a_end  # the second run waited for the first to release its slots

