"""The `sweep` flow: a grid of learning rates and LoRA ranks trained as concurrent `train` runs on one
shared cluster (`txflow.cluster.named`), each a full run with its own checkpoints, proofs and report, then a
ranking of the members (`txflow.reporting.sweep`) and, opt-in, the promotion of the best member that
passed. A member that fails fails only itself: the ranking names it and the others go on.

Every member is checked before anything starts (a bad point of the grid refuses the whole sweep in one
line, as a bad `txflow run` is refused), and the cluster is the one named (`config.cluster`) or one started
for the sweep with a slot for every member and the largest rank of the grid, stopped when the sweep ends."""

from __future__ import annotations

import contextvars
import ctypes
import re
import secrets
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prefect import flow

from flows.train import RunFailed, train_flow
from txflow.artifacts import promote
from txflow.cluster import named
from txflow.config import RunConfig, checked_promotion_name
from txflow.log import get_logger
from txflow.preflight import PreflightError, check_base_model, check_learning_rate, prepare
from txflow.processes.umask import private_files
from txflow.reporting import sweep as ranking
from txflow.reporting import tracking

# Adapter slots a member holds at its peak: its trained model, and the restore check's reloaded state and
# sampler (the check's base-model sample needs none). A named cluster runs as many members at once as its
# free slots allow; the others wait for one to end.
SLOTS_PER_MEMBER = 3


class SweepFailed(RuntimeError):
    """No member passed: the sweep has nothing to choose (its flow run fails); the ranking says why each failed."""

    def __init__(self, result: dict):
        super().__init__(f"sweep {result['sweep_id']}: no member passed ({len(result['members'])} failed); "
                         f"ranking {result['ranking_file']}")
        self.result = result


def new_sweep_id(mode: str) -> str:
    return f"sweep-{mode}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


@flow(name="sweep")
def sweep_flow(config: RunConfig = RunConfig(), learning_rates: list[float] | None = None,
               lora_ranks: list[int] | None = None, sweep_id: str | None = None,
               promote_best_as: str | None = None) -> dict:
    """Train every point of the grid side by side on one cluster (`config.cluster`, or one started for the
    sweep), rank them, and promote the best that passed as `promote_best_as` when given. The flow run fails
    only when no member passed (SweepFailed); a member that failed is in the ranking."""
    if promote_best_as is not None:  # before anything trains: it becomes a directory under promoted/
        checked_promotion_name(promote_best_as, "promote_best_as")
    if sweep_id is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,60}", sweep_id):  # it names directories
        raise ValueError(f"sweep_id {sweep_id!r} must be 1-60 letters, digits, '-' or '_'")
    sweep_id = sweep_id or new_sweep_id(config.mode)
    with private_files():
        members = members_of(config, learning_rates or [], lora_ranks or [], sweep_id)
        return _sweep(config, members, sweep_id, promote_best_as)


def state_of(config: RunConfig, sweep_id: str) -> Path:
    """The sweep's own state directory (its ranking; its members' state below it)."""
    return Path(config.state_dir or Path(".txflow") / "sweeps" / sweep_id).absolute()


def members_of(config: RunConfig, learning_rates: list[float], lora_ranks: list[int],
               sweep_id: str) -> list[RunConfig]:
    """The grid's run configs, each checked as `txflow run` checks a run (pre-flight: its data, its run id
    still free, its rank against the named cluster); the first bad one refuses the sweep (PreflightError)."""
    name = config.cluster or sweep_id
    members = ranking.grid(config, sweep_id, learning_rates, lora_ranks, name, state_of(config, sweep_id))
    model_path = check_base_model(config) if config.cluster else None  # the same for every member
    for member in members:  # what differs between members first: a refusal leaves nothing behind
        check_learning_rate(member)
        if config.cluster:
            try:
                named.check(member, model_path)
            except named.AttachFailed as exc:
                raise PreflightError(str(exc)) from None
    for member in members:
        # A cluster started for the sweep does not exist yet: check the member as a run of its own would be.
        prepare(member if config.cluster else member.model_copy(update={"cluster": None}))
    if config.cluster:
        serves = named.load_serves(config.cluster)
        if serves is not None and serves.lora_adapters - 1 < SLOTS_PER_MEMBER:
            raise PreflightError(f"--cluster {config.cluster} has {serves.lora_adapters - 1} adapter slots; a sweep "
                                 f"member needs {SLOTS_PER_MEMBER} at once")
    return members


def _sweep(config: RunConfig, members: list[RunConfig], sweep_id: str, promote_best_as: str | None) -> dict:
    log = get_logger()
    own = config.cluster is None
    name = members[0].cluster
    handle = None
    if own:
        shape = config.model_copy(update={
            "lora_adapters": max(config.lora_adapters, 1 + SLOTS_PER_MEMBER * len(members)),
            "max_lora_rank": max([config.max_lora_rank or 0, *(m.lora_rank for m in members)])})
        handle = named.up(shape, name)
        at_once = len(members)
    else:
        serves = named.load_serves(name)
        at_once = max(1, min(len(members), named.free_slots(serves, named.database_url(serves, config))
                             // SLOTS_PER_MEMBER))
    log.info(f"sweep {sweep_id}: {len(members)} runs on cluster {name}, {at_once} at once: "
             + ", ".join(f"{m.run_id} (lr {m.learning_rate:g}, rank {m.lora_rank})" for m in members))
    # One MLflow run for the sweep, its members' runs its children.
    parent = tracking.start_sweep(config, sweep_id, {"learning_rates": sorted({m.learning_rate for m in members}),
                                                     "lora_ranks": sorted({m.lora_rank for m in members})})
    if parent is not None:
        members = [m.model_copy(update={"tracking_parent": parent}) for m in members]
    reports, errors, running, spans = {}, {}, {}, {}
    lock = threading.Lock()

    def member(cfg: RunConfig):
        with lock:
            running[cfg.run_id] = threading.get_ident()
        started_at = time.time()
        try:
            report = train_flow(config=cfg)
        except RunFailed as failed:
            report = failed.report
        except Exception as exc:  # it failed before its report (its pre-flight, say): only itself
            with lock:
                errors[cfg.run_id] = " ".join(traceback.format_exception_only(exc)[-1].split())
            return
        finally:
            with lock:
                running.pop(cfg.run_id, None)
                spans[cfg.run_id] = (started_at, time.time())
        with lock:
            reports[cfg.run_id] = report

    pool = ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="txflow-sweep")
    futures = []
    try:
        # Each member runs as a subflow of the sweep (the copied context carries the parent flow run).
        futures = [pool.submit(contextvars.copy_context().run, member, m) for m in members]
        for future in futures:
            future.result()
    except BaseException:  # Ctrl-C, SIGTERM (`txflow sweep` turns it into KeyboardInterrupt)
        _stop_members(name, members, futures, pool, running, lock)
        tracking.finish_sweep(config, parent, {"best": None, "interrupted": True})
        raise
    finally:
        pool.shutdown(wait=False)
        if handle is not None:
            named.stop(handle, name)
    result = ranking.ranking(members, reports, errors, spans)
    result["sweep_id"], result["cluster"] = sweep_id, name
    result["promoted"] = None
    if promote_best_as and result["best"]:
        result["promoted"] = promote.best(config, result, reports, promote_best_as)
    state = state_of(config, sweep_id)
    ranking.write(state, sweep_id, result)
    tracking.finish_sweep(config, parent, result)
    _publish(sweep_id, result)
    log.info(f"sweep {sweep_id}: best {result['best']}; failed: {', '.join(result['failed']) or 'none'}; "
             f"ranking {result['ranking_file']}")
    if result["best"] is None:
        raise SweepFailed(result)
    return result


def _stop_members(name: str, members: list[RunConfig], futures: list, pool: ThreadPoolExecutor, running: dict,
                  lock: threading.Lock, timeout_s: float = 120.0) -> None:
    """The sweep was interrupted: each member still running, a thread of this process, gets the
    KeyboardInterrupt a `txflow run` gets from Ctrl-C, so it tears down as that run would (its models
    unloaded, its key revoked); members not begun never begin. A member not ended in `timeout_s` has its key
    taken from the cluster: its next request gets 403."""
    log = get_logger()
    log.warning(f"sweep interrupted: stopping its {len(members)} runs on cluster {name}")
    pool.shutdown(wait=False, cancel_futures=True)
    with lock:
        threads = dict(running)
    for ident in threads.values():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt))
    deadline = time.monotonic() + timeout_s
    while not all(f.done() for f in futures) and time.monotonic() < deadline:
        time.sleep(0.2)
    for member in members:
        named.revoke(name, member.run_id)
    if not all(f.done() for f in futures):
        log.warning(f"sweep interrupted: runs still running after {timeout_s:.0f} s lost their keys")


def _publish(sweep_id: str, result: dict) -> None:
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is not None:
        create_markdown_artifact(ranking.markdown(sweep_id, result), key=ranking.artifact_key(sweep_id),
                                 description="txflow sweep ranking")
