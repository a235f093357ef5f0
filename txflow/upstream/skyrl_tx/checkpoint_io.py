"""The `rank0-checkpoint-io` change: checkpoint I/O without a shared filesystem. A state save gathers the adapter's
weights and optimizer state and rank 0 alone writes them as one file (`layout.STATE_FILE`); state and sampler loads read
on rank 0 and broadcast. The `load-optimizer-flag` change: a state load restores the optimizer only when asked
(`load_optimizer`), else the model gets the fresh optimizer a new model gets. Installed in the engine and in every
worker (`ranks.run`)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from txflow.upstream.skyrl_tx.layout import STATE_FILE

STATE_FORMAT = 1
UPSTREAM_STATE_DIR = "checkpoint_0"  # what upstream's Orbax save leaves in the directory
STATE_TAG, UPSTREAM_TAG = b"S", b"O"  # first byte of what rank 0 broadcasts on a state load


def install_checkpoint_io() -> None:
    """Replace the backend's state save/load and sampler load, in this process (engine or worker)."""
    from tx.tinker.backends.jax import JaxBackend, JaxBackendImpl

    upstream_load_state = JaxBackendImpl.load_checkpoint
    upstream_load_sampler = JaxBackendImpl.load_sampler_checkpoint

    def load_checkpoint(self, checkpoint_path, model_id, load_optimizer=True):
        _load_state(self, upstream_load_state, checkpoint_path, model_id, load_optimizer)

    def load_sampler_checkpoint(self, model_id, checkpoint_id, checkpoint_path):
        _load_sampler(self, upstream_load_sampler, model_id, checkpoint_id, checkpoint_path)

    # The rank-0 wrapper serialises broadcast arguments by these annotations: keep upstream's.
    for name, replacement in (("save_checkpoint", _save_state), ("load_checkpoint", load_checkpoint),
                              ("load_sampler_checkpoint", load_sampler_checkpoint)):
        replacement.__annotations__ = dict(getattr(JaxBackendImpl, name).__annotations__)
        setattr(JaxBackendImpl, name, replacement)
    load_checkpoint.__annotations__["load_optimizer"] = bool

    def broadcast_load_checkpoint(self, checkpoint_path, model_id, load_optimizer=True):
        # Rank 0's wrapper: upstream's broadcasts the path and the model only (`load-optimizer-flag`).
        self._broadcast_and_call("load_checkpoint", checkpoint_path=checkpoint_path, model_id=model_id,
                                 load_optimizer=load_optimizer)

    JaxBackend.load_checkpoint = broadcast_load_checkpoint


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


def _load_state(self, upstream, checkpoint_path, model_id, load_optimizer: bool) -> None:
    """Rank 0 reads the state file and broadcasts it; every rank inserts its shards. Without
    `load_optimizer` the model's optimizer starts afresh (Tinker's `load_state`)."""
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
        # Saved by upstream's engine (or by txflow without `rank0-checkpoint-io`): Orbax restores on every rank, which
        # works where every rank sees the whole directory (one machine), as when it was saved.
        upstream(self, checkpoint_path, model_id)
        if not load_optimizer:
            _fresh_optimizer(self, model_id)
        return
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
        jax.make_array_from_callback(leaf.shape, leaf.sharding,
                                     lambda index, v=saved[jax.tree_util.keystr(p)]: v[index])
        for p, leaf in leaves
    ]
    arrays = jax.tree_util.tree_unflatten(treedef, restored)
    self._insert_checkpoint_data(model_id, {**arrays, "lora_config": lora_config})
    if not load_optimizer:
        _fresh_optimizer(self, model_id)


def _fresh_optimizer(self, model_id) -> None:
    """Give `model_id` the optimizer `create_model` gives a new model: Adam's moments and step count at zero (its
    hyperparameters come with every optim_step); that of its own slot with `optimizer-own-slot` (`new_optimizer`),
    else upstream's."""
    import jax
    import optax
    from flax import nnx

    if hasattr(self, "new_optimizer"):
        self.optimizers[model_id] = self.new_optimizer(self.models[model_id].adapter_index)
        return
    with jax.set_mesh(self.mesh):
        tx = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0)
        self.optimizers[model_id] = nnx.Optimizer(self.model, tx, wrt=self.model.is_lora_param)


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


def adapter_state_in_one_program() -> None:
    """Upstream slices an adapter's weights and optimizer state out of the slot-stacked arrays, and puts them back,
    with programs compiled for each slot index (`static_argnames`), so every restore into a slot the process had not
    used traced and compiled two programs again. Here the slot is a traced argument: one program each for every slot
    (`adapter-state-program`), the same arrays. Measured on SmolLM2, in one process with a warm compilation cache:
    loads into two new slots 3.9 and 5.1 s upstream, 2.9 and 0.6 s here (cold: 9.5 and 7.5 s, 8.3 and 0.5 s)."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tx.tinker.backends import jax as backend
    from tx.utils import models

    if getattr(models.insert_adapter_state, "txflow", False):
        return
    extract_one = jax.jit(models.extract_adapter_state.__wrapped__, static_argnames=("rank",))
    insert_one = nnx.jit(models.insert_adapter_state.__wrapped__, static_argnames=("rank",))  # in place, as upstream

    @functools.wraps(models.extract_adapter_state.__wrapped__)
    def extract_adapter_state(adapter_index, lora_params, rank):
        return extract_one(jnp.int32(adapter_index), lora_params, rank=rank)

    @functools.wraps(models.insert_adapter_state.__wrapped__)
    def insert_adapter_state(adapter_index, lora_params, new_params, rank):
        return insert_one(jnp.int32(adapter_index), lora_params, new_params, rank=rank)

    insert_adapter_state.txflow = True
    for module in (models, backend):
        module.extract_adapter_state, module.insert_adapter_state = extract_adapter_state, insert_adapter_state
