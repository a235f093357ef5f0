"""Everything specific to SkyRL-tx 0.3.0 (import name `tx`) lives here.

Upstream behaviours this adapter works around, each with how to tell when the
workaround can go:

1. `python -m tx.tinker.api` starts the engine itself with `uv run --extra
   tinker --extra jax -m tx.tinker.engine ...` in its FastAPI lifespan. We
   install with pip, so `uv` and a uv project are absent and the engine never
   starts. We serve the same FastAPI app with a lifespan that only prepares the
   database, and start the engine ourselves with this interpreter (see
   `serve_api`). Can go when upstream lets the API attach to an external engine.
2. The upstream lifespan logs the whole engine command line, database URL
   (password included) and all. Our lifespan logs nothing of it, the engine gets
   the URL through `TX_DATABASE_URL` (not argv, which `ps` shows), and every
   command line we log goes through `redact`.
3. The default device mesh (fsdp=ep=tp=1) is wrong for more than one process
   ("Array has no addressable shards"); `backend_config` derives a mesh whose
   product equals the device count, and a sampling batch that is a multiple of
   fsdp (sampling `num_samples=1` otherwise fails with fsdp > 1).
4. JAX's coordination service binds `[::]:<port>` (every interface) whatever
   host the coordinator address names; SkyRL-tx offers no setting for it. Rank
   0 gets `JAX_COORDINATOR_BIND_ADDRESS` (read by `jax.distributed.initialize`)
   so that it binds only the configured interface (`coordinator_env`).
5. Checkpoints: `save_state` writes a DIRECTORY named `<name>.tar.gz`,
   `save_weights_for_sampler` a real tarball under `sampler_weights/`; on S3 the
   state never reaches the bucket. The engine therefore always writes to local
   staging and txflow commits (see `txflow.storage`); the layout is named only
   here (`relative_checkpoint_path`, `tinker_path_for`). A checkpoint copied back
   from durable storage is registered in the engine's database
   (`register_checkpoint`), the only way 0.3.0 serves a checkpoint it did not
   write itself.
6. No filesystem is shared between ranks. Upstream saves the training state
   with `flax...save_checkpoint_multiprocess` (Orbax): every rank writes its
   shards into a directory rank 0 creates, so with node-local disks the other
   ranks wait for a directory they never see (600 s, then "Timed out waiting
   for array_metadatas base directory creation"), and a restore needs every
   rank's shards on every node. Sampler weights are written by every rank, but
   a sampler txflow imports from durable storage exists only where the import
   ran. So the engine and the workers run through this module
   (`engine`/`worker` entry points), which replaces three backend methods
   (`install_checkpoint_io`): a state save gathers the LoRA weights and their
   optimizer state to every host (a collective; LoRA state is megabytes, not
   the model) and rank 0 alone writes ONE file, `txflow-state.msgpack`, into
   the checkpoint directory; a state or sampler load reads the file on rank 0
   and broadcasts its bytes. Every checkpoint file therefore lives on rank 0's
   node, the coordinator node where txflow commits it (`txflow.storage`) with
   fsspec. We gather and broadcast instead of teaching Orbax to write to S3
   from every rank because the upstream path through cloudpathlib never
   reaches the bucket (see the notes), and one file per checkpoint is what the
   commit verifies cheaply. Can go when upstream saves without a shared disk.
7. SIGTERM does not stop a rank of a multi-process cluster: `jax.distributed.
   initialize` installs TSL's preemption notifier, which catches SIGTERM and
   only logs "SIGTERM caught", so every teardown waited out its grace period
   before SIGKILL. SkyRL-tx does nothing with preemption notices, so after
   initialize the engine and the workers get the default SIGTERM action back
   (`_default_sigterm_after_distributed_init`). Can go when upstream handles
   preemption or exits on it.
8. Start-up order. A worker started before rank 0's JAX coordinator listens would
   lean on JAX's connection retries, and the engine polls database tables that
   only the API creates. Waiting for each in the orchestrator serialises ~8 s of
   imports per rank; so every process starts at once and each entry point gates
   itself after its imports: a worker waits until the coordinator accepts
   connections (`_gate_on_coordinator`), the engine's request loop until the
   tables exist (`_engine_waits_for_tables`). Can go when upstream orders its
   own start-up.
9. Unloading a model frees its LoRA slot on rank 0 only: the distributed
   backend (`JaxBackend`) broadcasts `create_model` to the workers but not
   `delete_model`. After an unload, the next model gets one adapter index on
   rank 0 and another on the workers, and the first batched request that uses
   it fails ("passed to device_put is not the same on each process"; seen when
   a restore check loads sampler weights into a fresh slot). The engine's
   backend broadcasts `delete_model` too (`_broadcast_delete_model`). Can go
   when upstream's `JaxBackend` broadcasts it.
10. The API answers only what `tinker` 0.13 sends; newer SDKs (0.25, 0.38) call
    endpoints it lacks and speak protobuf. `serve_api` installs the shims of
    `txflow/tinker_compat.py`, which has its own numbered list.
11. `retrieve_future` long-polls the database with sleeps of 0.1 s growing by
    1.5x up to 1 s, so it looks at 0.1, 0.25, 0.475, 0.81, 1.32, ... s: a
    result is noticed up to ~50% late. A 0.26 s training step came back at 0.3
    or at 0.55 s, whichever side of a look it landed (the bimodal step times of
    the benchmark), and a 5 s request can wait 1 s more. `wait_for_result`
    (served by tinker_compat's `retrieve_future`) is upstream's loop with sleeps
    of a tenth of the time waited so far, between 10 ms and 0.25 s: a result is
    noticed at most ~10% late, for ~20 more looks at the database per second
    of waiting early on, fewer later. Can go when upstream's wait is tighter
    or notified. With 12., the schedule is only the fallback: a result is
    noticed when the engine's wake comes, with a look every 0.25 s besides.
12. The API and the engine find each other's work only by polling the
    database: besides 11., the engine sleeps 0.1 s after every pass over its
    pending requests, so each request that arrives while it sleeps (every
    training step's) waits up to 0.1 s before the engine sees it; that was a
    third of a 0.3 s step. With `wake_env` in both environments, each end
    sends the other a wake after the commits that matter (`txflow/wake.py`):
    the API after committing a new request (`create_future`'s session), the
    engine after completing futures (`_complete_futures`). The engine's 0.1 s
    sleep ends at a wake (after a 10 ms quiet spell, so that requests sent
    together are still batched together), and `wait_for_result` looks at
    once. The database stays the only source of truth; without wakes both
    ends poll as in 11. Can go when upstream's engine is notified of work.

Guarded: the adapter patches exactly the upstream version it was written
against (`UPSTREAM_VERSION`); another one is refused at pre-flight and by the
entry points, before anything is patched (`check_upstream_version`).

Module names differ in the unified `skyrl` 0.4.0 package (`skyrl.tinker.api`,
`skyrl.tinker.engine`, `skyrl.backends.jax`); they are only named here.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from txflow.config import RunConfig

UPSTREAM_PACKAGE = "skyrl-tx"
UPSTREAM_VERSION = "0.3.0"
ENGINE_MODULE = "tx.tinker.engine"
WORKER_MODULE = "tx.tinker.backends.jax"
DATABASE_URL_ENV = "TX_DATABASE_URL"

# SkyRL-tx 0.3.0's `ppo` loss clips the ratio at 1 +- 0.2, hard-coded (its loss_fn_config is ignored).
PPO_CLIP_EPSILON = 0.2
# The Tinker SDK's default LoRA rank; the cluster must accept at least it.
TINKER_DEFAULT_RANK = 32
# Adapter 0 is the base model; one for training, one per restore check, spare.
LORA_SLOTS_MIN = 8

# Credentials in URLs (scheme://user:password@host) and in key=value / JSON pairs.
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@\s]+)@")
_SECRET_PAIR = re.compile(
    r"(?P<key>\b[\w\-]*(?:secret|password|passwd|token|api[_\-]?key|credential)[\w\-]*\b"
    r"[\"']?\s*[:=]\s*)(?P<value>\"[^\"]*\"|'[^']*'|[^\s,\"'}]+)",
    re.IGNORECASE,
)
_BEARER = re.compile(r"(?P<key>\b(?:Bearer|Basic)\s+)(?P<value>[A-Za-z0-9._~+/=\-]+)", re.IGNORECASE)


def check_upstream_version() -> None:
    """Refuse an installed SkyRL-tx other than the one this adapter patches."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version(UPSTREAM_PACKAGE)
    except PackageNotFoundError:
        installed = None
    if installed != UPSTREAM_VERSION:
        found = f"{UPSTREAM_PACKAGE} {installed} is installed" if installed else f"{UPSTREAM_PACKAGE} is not installed"
        raise ValueError(f"{found}, but txflow's adapter (txflow/skyrl_adapter.py) works around the behaviour of "
                         f"{UPSTREAM_PACKAGE} {UPSTREAM_VERSION} and patches it: install "
                         f"{UPSTREAM_PACKAGE}=={UPSTREAM_VERSION} (see constraints.txt)")


def redact(text: str, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """`text` with URL passwords, secret-looking key=value pairs and each of `secrets` masked."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    text = _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    text = _BEARER.sub(lambda m: f"{m['key']}***", text)
    return _SECRET_PAIR.sub(lambda m: f"{m['key']}***", text)


def backend_config(cfg: RunConfig, coordinator_address: str | None) -> dict[str, Any]:
    """SkyRL-tx `JaxBackendConfig` for the cluster shape in `cfg`."""
    config: dict[str, Any] = {
        "fully_sharded_data_parallel_size": cfg.fsdp,
        "tensor_parallel_size": cfg.mesh.tp,
        "expert_parallel_size": cfg.mesh.ep,
        "max_lora_rank": cfg.max_lora_rank or max(TINKER_DEFAULT_RANK, cfg.lora_rank),
        "max_lora_adapters": LORA_SLOTS_MIN,
        # Pad every sampling batch to a multiple of fsdp (a batch of one fails otherwise).
        "sample_max_num_sequences": cfg.fsdp * max(1, 8 // cfg.fsdp),
    }
    if cfg.processes > 1:
        config["coordinator_address"] = coordinator_address
        config["num_processes"] = cfg.processes
    return config


def engine_args(
    cfg: RunConfig, base_model_path: str, checkpoints_base: str, coordinator_address: str | None
) -> list[str]:
    """Engine config as command-line arguments, without the database URL (it goes by environment)."""
    return [
        "--base-model",
        base_model_path,
        "--backend",
        "jax",
        "--backend-config",
        json.dumps(backend_config(cfg, coordinator_address)),
        "--checkpoints-base",
        checkpoints_base,
        # The client of a txflow run heartbeats while it runs; a crashed client's
        # adapters are freed after this long instead of leaking slots.
        "--session-timeout-sec",
        "120",
    ]


def wake_env() -> dict[str, str]:
    """Environment for the API and rank 0 (the engine) of one cluster: the name of their wake channel (12.)."""
    from txflow import wake

    return {wake.ENV: wake.new_name()}


def coordinator_env(coordinator_address: str | None) -> dict[str, str]:
    """Environment for rank 0 so the JAX coordinator binds only the configured interface."""
    return {"JAX_COORDINATOR_BIND_ADDRESS": coordinator_address} if coordinator_address else {}


def engine_command(engine_argv: list[str]) -> list[str]:
    """Rank 0: the engine, which hosts the JAX coordinator (with txflow's checkpoint I/O, see 6.)."""
    return [sys.executable, "-m", "txflow.skyrl_adapter", "engine", *engine_argv]


def api_command(engine_argv: list[str], host: str, port: int) -> list[str]:
    """The Tinker API server, without the engine it would otherwise spawn through `uv`."""
    return [sys.executable, "-m", "txflow.skyrl_adapter", "api", "--host", host, "--port", str(port), *engine_argv]


def worker_command(coordinator_address: str, num_processes: int, rank: int, gate_timeout_s: float) -> list[str]:
    """Rank > 0: a JAX worker that receives the model and config from rank 0 by broadcast. It joins
    once rank 0's coordinator accepts connections, and gives up after `gate_timeout_s` (see 8.)."""
    return [
        sys.executable,
        "-m",
        "txflow.skyrl_adapter",
        "worker",
        "--gate-timeout",
        str(gate_timeout_s),
        "--coordinator-address",
        coordinator_address,
        "--num-processes",
        str(num_processes),
        "--process-id",
        str(rank),
    ]


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """`tinker://<model_id>/weights/<name>` -> (model_id, "state", name); `tinker://<model_id>/<name>`
    or `.../sampler_weights/<name>` -> (model_id, "sampler", name)."""
    parts = path.removeprefix("tinker://").split("/")
    if len(parts) == 3 and parts[1] == "weights":
        return parts[0], "state", parts[2]
    if len(parts) == 3 and parts[1] == "sampler_weights":
        return parts[0], "sampler", parts[2]
    if len(parts) == 2:
        return parts[0], "sampler", parts[1]
    raise ValueError(f"not a tinker checkpoint path: {path}")


def relative_checkpoint_path(tinker_path: str) -> str:
    """Where SkyRL-tx 0.3.0 writes a checkpoint, relative to its checkpoints base.

    State: a directory `<model_id>/<name>.tar.gz/` (holding `STATE_FILE`, see 6., despite
    the suffix); sampler: a gzip tarball `<model_id>/sampler_weights/<name>.tar.gz`.
    """
    model_id, kind, name = parse_tinker_path(tinker_path)
    return f"{model_id}/{name}.tar.gz" if kind == "state" else f"{model_id}/sampler_weights/{name}.tar.gz"


def tinker_path_for(relative_path: str) -> str | None:
    """The tinker:// path of a checkpoint found at `relative_path` under the checkpoints base, or None."""
    parts = relative_path.strip("/").split("/")
    if len(parts) == 2 and parts[1].endswith(".tar.gz"):
        return f"tinker://{parts[0]}/weights/{parts[1].removesuffix('.tar.gz')}"
    if len(parts) == 3 and parts[1] == "sampler_weights" and parts[2].endswith(".tar.gz"):
        return f"tinker://{parts[0]}/{parts[2].removesuffix('.tar.gz')}"
    return None


def is_ephemeral_sampler(relative_path: str) -> bool:
    """Sampler weights written by `save_weights_and_get_sampling_client` (named `ss<N>_seq<M>`)."""
    return re.fullmatch(r"[^/]+/sampler_weights/ss\d+_seq\d+\.tar\.gz(\.probe)?", relative_path.strip("/")) is not None


def register_checkpoint(database_url: str, model_id: str, checkpoint_id: str, kind: str) -> None:
    """Record a checkpoint that txflow placed in the engine's checkpoints base as completed.

    SkyRL-tx only serves checkpoints its database knows (`validate_checkpoint`),
    and only at `<base>/<model_id>/...`. A checkpoint copied back from durable
    storage under a live model's id needs this row before load_state or a
    sampling client can use it. Can go when upstream can load from a URL.
    """
    from datetime import datetime, timezone

    from sqlmodel import Session, create_engine
    from tx.tinker import types
    from tx.tinker.db_models import CheckpointDB, CheckpointStatus

    checkpoint_type = types.CheckpointType.TRAINING if kind == "state" else types.CheckpointType.SAMPLER
    engine = create_engine(database_url)
    try:
        with Session(engine) as session:
            session.merge(CheckpointDB(model_id=model_id, checkpoint_id=checkpoint_id, checkpoint_type=checkpoint_type,
                                       status=CheckpointStatus.COMPLETED, completed_at=datetime.now(timezone.utc)))
            session.commit()
    finally:
        engine.dispose()


# Lines each rank logs once it can take part in collectives; used to name the
# rank that is missing when readiness times out.
RANK_READY_MARKERS = {
    "engine": "Starting background engine",
    "worker": "entering command loop",
}


def serve_api(argv: list[str]) -> None:
    """Run the upstream FastAPI app with a lifespan that does not spawn an engine."""
    import asyncio

    import uvicorn
    from sqlmodel import SQLModel
    from sqlalchemy.ext.asyncio import create_async_engine

    from tx.tinker import api
    from tx.tinker.config import EngineConfig, add_model
    from tx.tinker.db_models import enable_sqlite_wal, get_async_database_url
    from tx.utils.log import get_uvicorn_log_config

    from txflow import tinker_compat, wake

    parser = argparse.ArgumentParser(description="SkyRL-tx Tinker API without its engine spawn")
    add_model(parser, EngineConfig)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    engine_config = EngineConfig.model_validate({k: v for k, v in vars(args).items() if k in EngineConfig.model_fields})

    @asynccontextmanager
    async def lifespan(app):
        # Same database preparation as upstream's lifespan, minus the engine spawn.
        app.state.db_engine = create_async_engine(get_async_database_url(engine_config.database_url), echo=False)
        enable_sqlite_wal(app.state.db_engine.sync_engine)
        async with app.state.db_engine.begin() as conn:
            await conn.run_sync(SQLModel.metadata.create_all)
        app.state.external_inference_client = None
        channel = wake.Channel.from_env("api", "engine")  # (12.)
        app.state.result_wakes = wake.AsyncWakes(channel, asyncio.get_running_loop()) if channel else None
        yield
        if app.state.result_wakes:
            app.state.result_wakes.close()
        await app.state.db_engine.dispose()

    api.app.router.lifespan_context = lifespan
    _wake_engine_on_new_requests(api)
    tinker_compat.install(api.app)
    api.app.state.engine_config = engine_config
    uvicorn.run(api.app, host=args.host, port=args.port, log_config=get_uvicorn_log_config())


def _wake_engine_on_new_requests(api) -> None:
    """Every request the API stores goes through upstream's `create_future`: once the session that
    stored one commits, wake the engine (12.)."""
    from sqlalchemy import event

    upstream = api.create_future

    async def create_future(session, *args, **kwargs):
        request_id = await upstream(session, *args, **kwargs)
        wakes = api.app.state.result_wakes
        if wakes:
            event.listen(session.sync_session, "after_commit", lambda _session: wakes.channel.send(), once=True)
        return request_id

    api.create_future = create_future


# --- result latency (11.) and wake-ups (12.) -----------------------------------

RESULT_TIMEOUT_S = 300.0  # upstream's
RESULT_POLL_MIN_S, RESULT_POLL_MAX_S, RESULT_POLL_FRACTION = 0.01, 0.25, 0.1


def result_poll_s(waited_s: float) -> float:
    """The sleep before the next look: a tenth of the time waited so far, within [10 ms, 0.25 s]."""
    return min(RESULT_POLL_MAX_S, max(RESULT_POLL_MIN_S, RESULT_POLL_FRACTION * waited_s))


async def wait_for_result(request_id: str, req) -> Any:
    """Upstream's `retrieve_future` wait (the same answers: the result, 404, 400 with the engine's error,
    500, 408 after 300 s). It looks again when the engine's wake comes, else every 0.25 s (12.); without
    wakes, after `result_poll_s` instead of upstream's 0.1 s x 1.5^n (11.)."""
    return (await wait_for_future(request_id, req)).result_data


async def wait_for_future(request_id: str, req) -> Any:
    """`wait_for_result`, returning the completed future's row (its `request_type` included)."""
    import asyncio
    import time

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
                _say_once(wakes, "the engine's wakes reach the API")
            except TimeoutError:
                pass
    raise HTTPException(status_code=408, detail="Timeout waiting for result")


# --- checkpoint I/O without a shared filesystem (6.) ---------------------------

STATE_FILE = "txflow-state.msgpack"
"""The one file of a training-state checkpoint, inside the `<name>.tar.gz/` directory upstream names."""
STATE_FORMAT = 1
UPSTREAM_STATE_DIR = "checkpoint_0"  # what upstream's Orbax save leaves in the directory
STATE_TAG, UPSTREAM_TAG = b"S", b"O"  # first byte of what rank 0 broadcasts on a state load


def install_checkpoint_io() -> None:
    """Replace the backend's state save/load and sampler load, in this process (engine or worker)."""
    from tx.tinker.backends.jax import JaxBackendImpl

    upstream_load_state = JaxBackendImpl.load_checkpoint
    upstream_load_sampler = JaxBackendImpl.load_sampler_checkpoint

    def load_checkpoint(self, checkpoint_path, model_id):
        _load_state(self, upstream_load_state, checkpoint_path, model_id)

    def load_sampler_checkpoint(self, model_id, checkpoint_id, checkpoint_path):
        _load_sampler(self, upstream_load_sampler, model_id, checkpoint_id, checkpoint_path)

    # The rank-0 wrapper serialises broadcast arguments by these annotations: keep upstream's.
    for name, replacement in (("save_checkpoint", _save_state), ("load_checkpoint", load_checkpoint),
                              ("load_sampler_checkpoint", load_sampler_checkpoint)):
        replacement.__annotations__ = dict(getattr(JaxBackendImpl, name).__annotations__)
        setattr(JaxBackendImpl, name, replacement)


def _save_state(self, output_path, model_id) -> None:
    """Every rank: gather the adapter's weights and optimizer state; rank 0: write them to one file."""
    import jax
    import numpy as np
    from flax import serialization
    from jax.experimental import multihost_utils

    data = self._extract_checkpoint_data(model_id)
    leaves = jax.tree_util.tree_flatten_with_path(_state_arrays(data))[0]
    values = [leaf for _, leaf in leaves]
    if jax.process_count() > 1:
        values = multihost_utils.process_allgather(values, tiled=True)  # collective: every rank calls it
    if jax.process_index() != 0:
        return
    record = {
        "format": STATE_FORMAT,
        "lora_config": json.dumps(data["lora_config"]),
        "arrays": {jax.tree_util.keystr(path): np.asarray(v) for (path, _), v in zip(leaves, values)},
    }
    directory = Path(str(output_path))
    if directory.exists():  # upstream saves with overwrite=True
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    partial = directory / (STATE_FILE + ".partial")
    partial.write_bytes(serialization.msgpack_serialize(record))
    partial.replace(directory / STATE_FILE)  # a crash mid-write leaves no state file, so no checkpoint


def _load_state(self, upstream, checkpoint_path, model_id) -> None:
    """Rank 0 reads the state file and broadcasts it; every rank inserts its shards."""
    import jax
    from flax import serialization

    rank0 = jax.process_index() == 0
    payload = error = None
    if rank0:
        directory = Path(str(checkpoint_path))
        try:
            payload = STATE_TAG + (directory / STATE_FILE).read_bytes()
        except OSError as exc:
            if (directory / UPSTREAM_STATE_DIR).is_dir():
                payload = UPSTREAM_TAG
            else:
                error = FileNotFoundError(f"Training checkpoint not found in {checkpoint_path}: {exc}")
    payload = _broadcast_bytes(payload)
    if payload is None:
        # Nothing else in this command is collective: the other ranks go back to their loop and
        # rank 0 reports the error to the client.
        if error is not None:
            raise error
        return
    if payload == UPSTREAM_TAG:
        # Saved by upstream's engine (or txflow before 6.): Orbax restores on every rank, which works
        # where every rank sees the whole directory (one machine), as when it was saved.
        return upstream(self, checkpoint_path, model_id)
    record = serialization.msgpack_restore(payload[len(STATE_TAG):])
    target = self._extract_checkpoint_data(model_id)
    lora_config = json.loads(record["lora_config"])
    problem = _state_mismatch(record, lora_config, target)
    if problem:  # every rank decides the same from the same bytes; only rank 0 raises
        if rank0:
            raise ValueError(f"Training checkpoint {checkpoint_path} does not fit model {model_id}: {problem}")
        return
    leaves, treedef = jax.tree_util.tree_flatten_with_path(_state_arrays(target))
    saved = record["arrays"]
    restored = [
        jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index, v=saved[jax.tree_util.keystr(p)]: v[index])
        for p, leaf in leaves
    ]
    arrays = jax.tree_util.tree_unflatten(treedef, restored)
    self._insert_checkpoint_data(model_id, {**arrays, "lora_config": lora_config})


def _state_arrays(data: dict) -> dict:
    return {"lora_weights": data["lora_weights"], "optimizer_state": data["optimizer_state"]}


def _state_mismatch(record: dict, lora_config: dict, target: dict) -> str | None:
    import jax

    if record.get("format") != STATE_FORMAT:
        return f"state format {record.get('format')!r}, expected {STATE_FORMAT}"
    if lora_config.get("rank") != target["lora_config"]["rank"]:
        return f"LoRA rank {lora_config.get('rank')} in the checkpoint, {target['lora_config']['rank']} in the model"
    saved = record["arrays"]
    for path, leaf in jax.tree_util.tree_flatten_with_path(_state_arrays(target))[0]:
        key = jax.tree_util.keystr(path)
        if key not in saved:
            return f"{key} is missing"
        if tuple(saved[key].shape) != tuple(leaf.shape) or saved[key].dtype != leaf.dtype:
            return f"{key} is {saved[key].dtype}{list(saved[key].shape)}, expected {leaf.dtype}{list(leaf.shape)}"
    return None


def _load_sampler(self, upstream, model_id, checkpoint_id, checkpoint_path) -> None:
    """Rank 0 reads the sampler tarball and broadcasts it; the other ranks load it from a temp file."""
    import jax

    if jax.process_count() == 1:
        return upstream(self, model_id, checkpoint_id, checkpoint_path)
    rank0 = jax.process_index() == 0
    payload = None
    if rank0:
        try:
            payload = Path(str(checkpoint_path)).read_bytes()
        except OSError:
            pass
    payload = _broadcast_bytes(payload)
    if payload is None:
        # Inside a sample command: every rank must stop here, or the ranks fall out of step.
        raise FileNotFoundError(f"Sampler checkpoint {checkpoint_path} is not readable on rank 0")
    if rank0:
        return upstream(self, model_id, checkpoint_id, checkpoint_path)
    with tempfile.TemporaryDirectory(prefix="txflow-sampler-") as tmp:
        local = Path(tmp) / Path(str(checkpoint_path)).name
        local.write_bytes(payload)
        upstream(self, model_id, checkpoint_id, local)


def _broadcast_bytes(data: bytes | None) -> bytes | None:
    """Rank 0's `data` on every rank (None when rank 0 has none); collective when several processes run."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return data
    size = np.array([-1 if data is None else len(data)], dtype=np.int64)
    size = int(multihost_utils.broadcast_one_to_all(size)[0])
    if size < 0:
        return None
    buffer = np.frombuffer(data, dtype=np.uint8) if jax.process_index() == 0 else np.zeros(size, dtype=np.uint8)
    return multihost_utils.broadcast_one_to_all(buffer).tobytes()


def _broadcast_delete_model() -> None:
    """Rank 0's backend tells the workers to free a deleted model's slot too (point 9)."""
    from tx.tinker.backends.jax import JaxBackend

    def delete_model(self, model_id: str) -> None:
        self._broadcast_and_call("delete_model", model_id=model_id)

    JaxBackend.delete_model = delete_model


def _default_sigterm_after_distributed_init() -> None:
    """Make `jax.distributed.initialize` give SIGTERM its default action back (point 7)."""
    import signal

    import jax

    initialize = jax.distributed.initialize

    def initialize_then_default_sigterm(*args, **kwargs):
        initialize(*args, **kwargs)
        # A kernel-level action: it stops the rank also while its main thread waits in a collective.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    jax.distributed.initialize = initialize_then_default_sigterm


def _gate_on_coordinator(address: str, timeout_s: float) -> None:
    """Block until rank 0's JAX coordinator accepts connections (8.); exit with a message after `timeout_s`."""
    import socket
    import time

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            print(f"txflow: coordinator {address} accepts connections; joining", file=sys.stderr, flush=True)
            return
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"txflow: rank 0's JAX coordinator did not listen on {address} within {timeout_s:.0f} s")
            time.sleep(0.1)


def _engine_waits_for_tables(timeout_s: float = 300.0) -> None:
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


def _say_once(holder, text: str) -> None:
    """One line in this process's log the first time a wake arrives: proof that the channel works."""
    if not getattr(holder, "said", False):
        holder.said = True
        print(f"txflow: {text} (adapter point 12)", file=sys.stderr, flush=True)


class _EngineClock:
    """What upstream's engine module sees as `time`. Its one `time.sleep`, the 0.1 s after each pass over
    the pending requests, ends early at the API's wake (12.); everything else is the `time` module."""

    def __init__(self, channel):
        self._channel = channel

    def sleep(self, seconds: float) -> None:
        if self._channel.sleep(seconds):
            _say_once(self, "the API's wakes reach the engine")

    def __getattr__(self, name: str):
        import time

        return getattr(time, name)


def _engine_wakes(engine_module) -> None:
    """The engine's end of the wake channel (12.): woken by new requests, waking the API once its
    results are committed."""
    from txflow import wake

    channel = wake.Channel.from_env("engine", "api")
    if channel is None:
        return
    engine_module.time = _EngineClock(channel)
    upstream_complete = engine_module.TinkerEngine._complete_futures

    def _complete_futures(self, results):
        upstream_complete(self, results)
        channel.send()

    engine_module.TinkerEngine._complete_futures = _complete_futures


def run_upstream(module: str, argv: list[str], gate_timeout_s: float | None = None) -> None:
    """Run an upstream entry point (engine or worker) with txflow's checkpoint I/O installed; a worker
    given `gate_timeout_s` joins only once rank 0's coordinator listens (8.)."""
    import importlib

    entry = importlib.import_module(module)  # the slow part (~8 s), before any gate
    install_checkpoint_io()
    _default_sigterm_after_distributed_init()
    if module == ENGINE_MODULE:
        _engine_waits_for_tables()
        _broadcast_delete_model()
        _engine_wakes(entry)
    if gate_timeout_s is not None:
        _gate_on_coordinator(argv[argv.index("--coordinator-address") + 1], gate_timeout_s)
    sys.argv = [module, *argv]
    entry.main()


if __name__ == "__main__":
    from txflow import lifeline

    lifeline.watch_parent()  # first: this process dies with the one that started it
    command, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    try:
        check_upstream_version()
    except ValueError as exc:
        sys.exit(f"txflow: {exc}")
    if command == "api":
        serve_api(rest)
    elif command == "engine":
        run_upstream(ENGINE_MODULE, rest)
    elif command == "worker" and rest[:1] == ["--gate-timeout"]:
        run_upstream(WORKER_MODULE, rest[2:], gate_timeout_s=float(rest[1]))
    else:
        sys.exit("usage: python -m txflow.skyrl_adapter {api --host H --port P|engine|worker --gate-timeout S} "
                 "<upstream args>")
