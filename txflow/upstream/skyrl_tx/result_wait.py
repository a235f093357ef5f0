"""The API's wait for a result (the `result-wait` and `wake-channel` changes), below both the API's own routes and the
SDK shims of `tinker_compat` that serve `retrieve_future`."""

from __future__ import annotations

import time
from typing import Any

RESULT_TIMEOUT_S = 300.0  # upstream's
RESULT_POLL_MIN_S, RESULT_POLL_MAX_S, RESULT_POLL_FRACTION = 0.01, 0.25, 0.1


def result_poll_s(waited_s: float) -> float:
    """The sleep before the next look: a tenth of the time waited so far, within [10 ms, 0.25 s]."""
    return min(RESULT_POLL_MAX_S, max(RESULT_POLL_MIN_S, RESULT_POLL_FRACTION * waited_s))


async def wait_for_result(request_id: str, req) -> Any:
    """Upstream's `retrieve_future` wait (the same answers: the result, 404, 400 with the engine's error,
    500, 408 after 300 s). It looks again when the engine's wake comes, else every 0.25 s (`wake-channel`); without
    wakes, after `result_poll_s` instead of upstream's 0.1 s x 1.5^n (`result-wait`)."""
    return (await wait_for_future(request_id, req)).result_data


async def wait_for_future(request_id: str, req) -> Any:
    """`wait_for_result`, returning the completed future's row (its `request_type` included)."""
    import asyncio

    from fastapi import HTTPException
    from sqlalchemy.exc import TimeoutError as SATimeoutError
    from sqlmodel import select
    from sqlmodel.ext.asyncio.session import AsyncSession
    from tx.tinker.db_models import FutureDB, RequestStatus

    wakes = getattr(req.app.state, "result_wakes", None)
    began = time.perf_counter()
    while time.perf_counter() - began < RESULT_TIMEOUT_S:
        woken = wakes.event() if wakes else None  # before the look: a wake during it is not missed
        try:
            async with AsyncSession(req.app.state.db_engine) as session:
                # The status first, so that a pending future's result JSON is not read on every look.
                found = await session.exec(select(FutureDB.status).where(FutureDB.request_id == int(request_id)))
                status = found.first()
                if not status:
                    raise HTTPException(status_code=404, detail="Future not found")
                if status in (RequestStatus.COMPLETED, RequestStatus.FAILED):
                    found = await session.exec(select(FutureDB).where(FutureDB.request_id == int(request_id)))
                    future = found.first()
                    if future.status == RequestStatus.COMPLETED:
                        return future
                    if future.result_data and "error" in future.result_data:
                        raise HTTPException(status_code=400, detail=future.result_data["error"])
                    raise HTTPException(status_code=500, detail="Unknown error")
        except SATimeoutError:
            pass
        if woken is None:
            await asyncio.sleep(result_poll_s(time.perf_counter() - began))
        else:
            try:
                await asyncio.wait_for(woken.wait(), RESULT_POLL_MAX_S)
            except TimeoutError:
                pass
    raise HTTPException(status_code=408, detail="Timeout waiting for result")
