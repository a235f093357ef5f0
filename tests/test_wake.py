"""The `wake-channel` change: the API and the engine wake each other (`txflow/upstream/wake.py`), on real sockets and,
for the API's side, upstream's own tables in a real SQLite database. The bounds here only tell a
wake from a sleep that ran out (seconds against tens of seconds); speed is the benchmark's business."""

from __future__ import annotations

import asyncio
import select
import threading
import time
from types import SimpleNamespace

import pytest
from pydantic import BaseModel
from sqlalchemy.ext.asyncio import create_async_engine
from sqlmodel import SQLModel
from sqlmodel.ext.asyncio.session import AsyncSession
from tx.tinker import api, types
from tx.tinker.db_models import FutureDB, RequestStatus

from tests.test_result_wait import _add
from txflow.upstream import wake
from txflow.upstream.skyrl_tx import api as txflow_api
from txflow.upstream.skyrl_tx import engine, launch, result_wait

pytestmark = [pytest.mark.timed]

LONG_S = 30.0  # a sleep that a wake must cut short


def pair() -> tuple[wake.Channel, wake.Channel]:
    name = wake.new_name()
    return wake.Channel(name, "api", "engine"), wake.Channel(name, "engine", "api")


def woken_within(channel: wake.Channel, seconds: float) -> bool:
    return bool(select.select([channel], [], [], seconds)[0])


def test_a_wake_cuts_a_sleep_short_and_a_sleep_without_one_runs_out():
    api_end, engine_end = pair()
    try:
        assert engine_end.sleep(0.05) is False  # nothing came: the whole sleep, as upstream
        threading.Timer(0.2, api_end.send).start()
        began = time.monotonic()
        assert engine_end.sleep(LONG_S) is True
        assert time.monotonic() - began < LONG_S / 3
    finally:
        api_end.close(), engine_end.close()


def test_wakes_that_came_while_busy_end_the_next_sleep_and_are_all_consumed():
    api_end, engine_end = pair()
    try:
        for _ in range(3):  # requests committed while the engine was working
            api_end.send()
        assert engine_end.sleep(LONG_S) is True
        assert engine_end.drain() == 0
    finally:
        api_end.close(), engine_end.close()


def test_a_stream_of_wakes_never_stretches_a_sleep_past_its_length():
    api_end, engine_end = pair()
    stop = threading.Event()

    def keep_waking():  # for 5 s at most: a sleep stretched by wakes ends with them, and fails below
        until = time.monotonic() + 5.0
        while not stop.is_set() and time.monotonic() < until:
            api_end.send()
            time.sleep(0.002)

    sender = threading.Thread(target=keep_waking)
    sender.start()
    try:
        began = time.monotonic()
        engine_end.sleep(0.3)
        assert time.monotonic() - began < 3.0  # coalescing waits for quiet, but never past the sleep
    finally:
        stop.set()
        sender.join()
        api_end.close(), engine_end.close()


def test_sending_to_an_end_that_is_not_up_is_harmless(monkeypatch):
    name = wake.new_name()
    lone = wake.Channel(name, "api", "engine")
    try:
        lone.send()  # the engine has not bound yet: no error, nothing to do
        engine_end = wake.Channel(name, "engine", "api")
        try:
            assert engine_end.drain() == 0  # the early wake went nowhere
            lone.send()  # and the channel works once the engine is up
            assert woken_within(engine_end, LONG_S) and engine_end.drain() == 1
        finally:
            engine_end.close()
    finally:
        lone.close()


def test_no_channel_without_the_name_or_when_the_name_is_taken(monkeypatch):
    monkeypatch.delenv(wake.ENV, raising=False)
    assert wake.Channel.from_env("api", "engine") is None
    name = wake.new_name()
    monkeypatch.setenv(wake.ENV, name)
    first = wake.Channel.from_env("api", "engine")
    try:
        assert first is not None
        assert wake.Channel.from_env("api", "engine") is None  # a second API on the same name polls alone
    finally:
        first.close()


def test_the_provisioned_environment_names_a_fresh_channel_per_cluster():
    first, second = launch.wake_env(), launch.wake_env()
    assert set(first) == {wake.ENV} and first[wake.ENV] != second[wake.ENV]


class FakeEngineModule:
    """What `_engine_wakes` touches of `tx.tinker.engine`: its `time` and `TinkerEngine._complete_futures`."""

    def __init__(self):
        completed = self.completed = []

        class TinkerEngine:
            def _complete_futures(self, results):
                completed.append(results)

        self.TinkerEngine = TinkerEngine
        self.time = time


def test_the_engine_sleeps_until_a_wake_and_wakes_the_api_once_results_are_committed(monkeypatch, capfd):
    name = wake.new_name()
    monkeypatch.setenv(wake.ENV, name)
    api_end = wake.Channel(name, "api", "engine")
    module = FakeEngineModule()
    engine.wakes(module)
    try:
        assert module.time.time() == pytest.approx(time.time(), abs=5)  # the rest of `time` is untouched
        threading.Timer(0.2, api_end.send).start()
        began = time.monotonic()
        module.time.sleep(LONG_S)  # upstream's 0.1 s between passes, made long
        assert time.monotonic() - began < LONG_S / 3
        assert "the API's wakes reach the engine" in capfd.readouterr().err

        assert not woken_within(api_end, 0.05)
        module.TinkerEngine()._complete_futures({"7": "result"})
        assert module.completed == [{"7": "result"}]  # upstream's commit, then the wake
        assert woken_within(api_end, 5.0)
    finally:
        module.time._channel.close()
        api_end.close()


def test_without_a_channel_the_engine_is_upstreams(monkeypatch):
    monkeypatch.delenv(wake.ENV, raising=False)
    module = FakeEngineModule()
    upstream = module.TinkerEngine._complete_futures
    engine.wakes(module)
    assert module.time is time and module.TinkerEngine._complete_futures is upstream


class Request(BaseModel):
    note: str = ""


async def _database(tmp_path):
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'tinker.db'}")
    async with engine.begin() as conn:
        await conn.run_sync(SQLModel.metadata.create_all)
    return engine


def test_the_api_wakes_the_engine_once_a_new_request_is_committed_and_not_before(tmp_path):
    async def scenario():
        db = await _database(tmp_path)
        api_end, engine_end = pair()
        wakes = wake.AsyncWakes(api_end, asyncio.get_running_loop())
        fake_api = SimpleNamespace(create_future=api.create_future,
                                   app=SimpleNamespace(state=SimpleNamespace(result_wakes=wakes,
                                                                             burst=txflow_api.Burst(api_end.send))))
        txflow_api._wake_engine_on_new_requests(fake_api)
        try:
            async with AsyncSession(db) as session:  # a commit that stores no request: no wake
                session.add(FutureDB(request_type=types.RequestType.OPTIM_STEP, request_data={}))
                await session.commit()
            assert not woken_within(engine_end, 0.05)
            async with AsyncSession(db) as session:
                request_id = await fake_api.create_future(session, types.RequestType.OPTIM_STEP, None, Request())
                assert not woken_within(engine_end, 0.05)  # stored, not yet committed: the engine could not see it
                await session.commit()
            assert woken_within(engine_end, 5.0)
            async with AsyncSession(db) as session:  # what the wake announces is in the database
                assert (await session.get(FutureDB, request_id)).status == RequestStatus.PENDING
        finally:
            wakes.close()
            engine_end.close()
            await db.dispose()

    asyncio.run(scenario())


def test_requests_in_flight_together_wake_the_engine_once_after_the_last_is_stored():
    """An RL step's samples (a step's forward_backward and optim_step) are handled by the API one after the
    other: a wake at each commit let the engine start on the first alone. Through the middleware, on real
    sockets: the wake waits for the last storing request in flight, and a request that fails before it
    stores anything still releases the wake of the others."""
    api_end, engine_end = pair()
    burst = txflow_api.Burst(api_end.send)
    gates = {path: asyncio.Event() for path in ("/api/v1/asample", "/api/v1/optim_step")}

    async def inner(scope, receive, send):  # a route: stores its request when its gate opens (or fails)
        await gates[scope["path"]].wait()
        if scope.get("fails"):
            raise RuntimeError("refused before storing")
        burst.stored()

    def scope(path, **extra):
        return {"type": "http", "method": "POST", "path": path,
                "app": SimpleNamespace(state=SimpleNamespace(burst=burst)), **extra}

    async def scenario():
        middleware = txflow_api.BurstCount(inner)
        first = asyncio.create_task(middleware(scope("/api/v1/asample"), None, None))
        second = asyncio.create_task(middleware(scope("/api/v1/optim_step", fails=True), None, None))
        await asyncio.sleep(0.01)
        gates["/api/v1/asample"].set()
        await first
        assert not woken_within(engine_end, 0.05)  # stored, but another storing request is still in flight
        gates["/api/v1/optim_step"].set()
        with pytest.raises(RuntimeError):
            await second
        assert woken_within(engine_end, 5.0)  # the last one ended (without storing): the wake goes
        assert engine_end.drain() == 1
        burst.stored()  # stored outside a counted request: at once
        assert woken_within(engine_end, 5.0)

    try:
        asyncio.run(scenario())
    finally:
        api_end.close()
        engine_end.close()


def test_a_waiting_result_is_returned_at_the_engines_wake_not_at_the_next_look(tmp_path, monkeypatch, capfd):
    # Every look of either schedule made as long as the test: only the wake can end the wait in time.
    monkeypatch.setattr(result_wait, "RESULT_POLL_MAX_S", LONG_S)
    monkeypatch.setattr(result_wait, "RESULT_POLL_MIN_S", LONG_S)

    async def scenario():
        db = await _database(tmp_path)
        api_end, engine_end = pair()
        wakes = wake.AsyncWakes(api_end, asyncio.get_running_loop())
        req = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(db_engine=db, result_wakes=wakes)))
        try:
            request_id = await _add(db)  # a pending request, as the API stores it
            waiting = asyncio.create_task(result_wait.wait_for_result(str(request_id), req))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            async with AsyncSession(db) as session:  # the engine completes it, then wakes the API
                future = await session.get(FutureDB, request_id)
                future.status, future.result_data = RequestStatus.COMPLETED, {"loss": 1.5}
                await session.commit()
            engine_end.send()
            assert await asyncio.wait_for(waiting, LONG_S / 3) == {"loss": 1.5}
        finally:
            wakes.close()
            engine_end.close()
            await db.dispose()

    asyncio.run(scenario())
    assert "the engine's wakes reach the API" in capfd.readouterr().err


def test_the_api_says_the_engines_wakes_reach_it_when_one_comes_though_no_wait_ends(capfd):
    """The proof that the channel works is said when the first wake arrives, not when it ends a wait: a result the
    API's look finds completed ends no wait, though its wake came."""

    async def scenario():
        api_end, engine_end = pair()
        wakes = wake.AsyncWakes(api_end, asyncio.get_running_loop())
        try:
            arrived = wakes.event()
            engine_end.send()  # no result's wait is there to end
            await asyncio.wait_for(arrived.wait(), 5)
        finally:
            wakes.close()
            engine_end.close()

    asyncio.run(scenario())
    assert capfd.readouterr().err.count("the engine's wakes reach the API") == 1


def test_a_wake_that_comes_while_the_api_looks_is_not_missed(tmp_path, monkeypatch):
    """The engine completes the result just after the API's look read it as pending, and wakes the
    API before the API starts waiting: the wait must end at once, not at the next look."""
    monkeypatch.setattr(result_wait, "RESULT_POLL_MAX_S", LONG_S)
    monkeypatch.setattr(result_wait, "RESULT_POLL_MIN_S", LONG_S)
    upstream_exec = AsyncSession.exec
    raced = []

    async def scenario():
        db = await _database(tmp_path)
        api_end, engine_end = pair()
        wakes = wake.AsyncWakes(api_end, asyncio.get_running_loop())
        req = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(db_engine=db, result_wakes=wakes)))
        request_id = await _add(db)  # a pending request, as the API stores it

        async def exec_then_engine_finishes(self, statement, *args, **kwargs):
            found = await upstream_exec(self, statement, *args, **kwargs)
            if not raced:  # the first look has read "pending"; now the engine is done, and says so
                raced.append(True)
                async with AsyncSession(db) as other:
                    done = await other.get(FutureDB, request_id)
                    done.status, done.result_data = RequestStatus.COMPLETED, {"loss": 0.5}
                    await other.commit()
                engine_end.send()
                await asyncio.sleep(0.1)  # the API's loop reads the wake while the look is still going
            return found

        monkeypatch.setattr(AsyncSession, "exec", exec_then_engine_finishes)
        try:
            result = await asyncio.wait_for(result_wait.wait_for_result(str(request_id), req), LONG_S / 3)
            assert result == {"loss": 0.5} and raced
        finally:
            wakes.close()
            engine_end.close()
            await db.dispose()

    asyncio.run(scenario())
