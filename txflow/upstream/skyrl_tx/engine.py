"""Rank 0, the engine (which hosts the JAX coordinator): points 8 (it waits for the API's tables),
9 (unloads reach the workers) and its end of 12 (wakes to and from the API)."""

from __future__ import annotations

from txflow.upstream import wake
from txflow.upstream.skyrl_tx import ENGINE_MODULE, ranks


def broadcast_delete_model() -> None:
    """Rank 0's backend tells the workers to free a deleted model's slot too (point 9)."""
    from tx.tinker.backends.jax import JaxBackend

    def delete_model(self, model_id: str) -> None:
        self._broadcast_and_call("delete_model", model_id=model_id)

    JaxBackend.delete_model = delete_model


def waits_for_tables(timeout_s: float = 300.0) -> None:
    """The engine's request loop starts once the API has created the database tables (8.)."""
    import time

    from sqlalchemy import inspect
    from tx.tinker.engine import TinkerEngine

    upstream_run = TinkerEngine.run

    def run(self):
        deadline = time.monotonic() + timeout_s
        while not inspect(self.db_engine).has_table("futures"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Tinker API did not create the database tables within {timeout_s:.0f} s")
            time.sleep(0.1)
        return upstream_run(self)

    TinkerEngine.run = run


class _EngineClock:
    """What upstream's engine module sees as `time`. Its one `time.sleep`, the 0.1 s after each pass over
    the pending requests, ends early at the API's wake (12.); everything else is the `time` module."""

    def __init__(self, channel):
        self._channel = channel

    def sleep(self, seconds: float) -> None:
        if self._channel.sleep(seconds):
            wake.say_once(self, "the API's wakes reach the engine")

    def __getattr__(self, name: str):
        import time

        return getattr(time, name)


def wakes(engine_module) -> None:
    """The engine's end of the wake channel (12.): woken by new requests, waking the API once its
    results are committed."""
    channel = wake.Channel.from_env("engine", "api")
    if channel is None:
        return
    engine_module.time = _EngineClock(channel)
    upstream_complete = engine_module.TinkerEngine._complete_futures

    def _complete_futures(self, results):
        upstream_complete(self, results)
        channel.send()

    engine_module.TinkerEngine._complete_futures = _complete_futures


def run(argv: list[str]) -> None:
    """The engine with txflow's patches, on upstream's command line `argv`."""

    def patch(entry) -> None:
        waits_for_tables()
        broadcast_delete_model()
        wakes(entry)

    ranks.run(ENGINE_MODULE, argv, patch)
