"""The `result-wait` change: the API's wait for a result (`result_wait.wait_for_result`) against upstream's
own tables in a real SQLite database: the same answers as upstream's `retrieve_future`, and a schedule
of looks that notices a result at most a tenth late."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fastapi import HTTPException
from sqlalchemy.ext.asyncio import create_async_engine
from sqlmodel import SQLModel
from sqlmodel.ext.asyncio.session import AsyncSession
from tx.tinker import types
from tx.tinker.db_models import FutureDB, RequestStatus

from txflow.upstream.skyrl_tx import result_wait

pytestmark = [pytest.mark.timed]


def test_a_result_is_noticed_at_most_a_tenth_late_or_10_ms():
    looks = [0.0]
    while looks[-1] < result_wait.RESULT_TIMEOUT_S:
        looks.append(looks[-1] + result_wait.result_poll_s(looks[-1]))
    for before, after in zip(looks, looks[1:]):
        # A result that lands just after a look is seen at the next one.
        assert after - before <= max(0.01, 0.1 * before) + 1e-9, (before, after)
    assert sum(look < 1.0 for look in looks) <= 40  # the price: a bounded number of looks at the database
    assert len(looks) < 1400  # over the whole 300 s: ~0.25 s apart once a wait is long


async def _run(tmp_path, scenario):
    engine = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'tinker.db'}")
    async with engine.begin() as conn:
        await conn.run_sync(SQLModel.metadata.create_all)
    req = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(db_engine=engine)))
    try:
        return await scenario(engine, req)
    finally:
        await engine.dispose()


async def _add(engine, **fields) -> int:
    async with AsyncSession(engine) as session:
        future = FutureDB(request_type=types.RequestType.OPTIM_STEP, request_data={}, **fields)
        session.add(future)
        await session.commit()
        await session.refresh(future)
        return future.request_id


def test_a_pending_result_is_returned_once_the_engine_completes_it(tmp_path):
    async def scenario(engine, req):
        request_id = await _add(engine)
        waiting = asyncio.create_task(result_wait.wait_for_result(str(request_id), req))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        async with AsyncSession(engine) as session:  # what the engine does when it is done
            future = await session.get(FutureDB, request_id)
            future.status, future.result_data = RequestStatus.COMPLETED, {"loss": 1.5}
            session.add(future)
            await session.commit()
        return await asyncio.wait_for(waiting, timeout=10)

    assert asyncio.run(_run(tmp_path, scenario)) == {"loss": 1.5}


@pytest.mark.parametrize("fields, status, detail", [
    ({"status": RequestStatus.FAILED, "result_data": {"error": "bad adapter"}}, 400, "bad adapter"),
    ({"status": RequestStatus.FAILED}, 500, "Unknown error"),
    (None, 404, "Future not found"),
])
def test_failures_answer_as_upstream_does(tmp_path, fields, status, detail):
    async def scenario(engine, req):
        request_id = await _add(engine, **fields) if fields is not None else 12345
        with pytest.raises(HTTPException) as raised:
            await result_wait.wait_for_result(str(request_id), req)
        return raised.value

    error = asyncio.run(_run(tmp_path, scenario))
    assert (error.status_code, error.detail) == (status, detail)
