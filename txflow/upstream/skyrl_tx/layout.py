"""The `staged-checkpoints` change: where SkyRL-tx 0.3.0 writes each checkpoint, the tinker:// paths that name them
(Tinker's: `tinker://<model_id>/weights/<name>` and `tinker://<model_id>/sampler_weights/<name>`, the
`tinker-sampler-paths` change), and the one way to make it serve a checkpoint it did not write
(`register_checkpoint`)."""

from __future__ import annotations

import re
from datetime import UTC

STATE_FILE = "txflow-state.msgpack"
"""The one file of a training-state checkpoint, inside the `<name>.tar.gz/` directory upstream names
(written by txflow's checkpoint I/O, the `rank0-checkpoint-io` change)."""


def tinker_path(model_id: str, kind: str, name: str) -> str:
    """Tinker's path of checkpoint `name` of `model_id`; `kind` is "state" or "sampler"."""
    return f"tinker://{model_id}/{'weights' if kind == 'state' else 'sampler_weights'}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """`tinker://<model_id>/weights/<name>` -> (model_id, "state", name); `tinker://<model_id>/sampler_weights/<name>`,
    or upstream's `tinker://<model_id>/<name>` (`tinker-sampler-paths`), -> (model_id, "sampler", name)."""
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

    State: a directory `<model_id>/<name>.tar.gz/` (holding `STATE_FILE`, `rank0-checkpoint-io`, despite
    the suffix); sampler: a gzip tarball `<model_id>/sampler_weights/<name>.tar.gz`.
    """
    model_id, kind, name = parse_tinker_path(tinker_path)
    return f"{model_id}/{name}.tar.gz" if kind == "state" else f"{model_id}/sampler_weights/{name}.tar.gz"


def tinker_path_for(relative_path: str) -> str | None:
    """The tinker:// path of a checkpoint found at `relative_path` under the checkpoints base, or None."""
    parts = relative_path.strip("/").split("/")
    if len(parts) == 2 and parts[1].endswith(".tar.gz"):
        return tinker_path(parts[0], "state", parts[1].removesuffix(".tar.gz"))
    if len(parts) == 3 and parts[1] == "sampler_weights" and parts[2].endswith(".tar.gz"):
        return tinker_path(parts[0], "sampler", parts[2].removesuffix(".tar.gz"))
    return None


EXTERNAL_PREFIX = "external_weights-"
"""The sampler name under which an external-weights export (`save_weights_external`, the `rest-surface` change) is
saved."""


def is_ephemeral_sampler(relative_path: str) -> bool:
    """Sampler weights written by `save_weights_and_get_sampling_client` (named `ss<N>_seq<M>`), or an
    external-weights export (a copy, deleted by its client or when its TTL ends): not committed."""
    return re.fullmatch(rf"[^/]+/sampler_weights/(ss\d+_seq\d+|{EXTERNAL_PREFIX}[^/]+)\.tar\.gz(\.probe)?",
                        relative_path.strip("/")) is not None


def register_checkpoint(database_url: str, model_id: str, checkpoint_id: str, kind: str) -> None:
    """Record a checkpoint that txflow placed in the engine's checkpoints base as completed.

    SkyRL-tx only serves checkpoints its database knows (`validate_checkpoint`),
    and only at `<base>/<model_id>/...`. A checkpoint copied back from durable
    storage under a live model's id needs this row before load_state or a
    sampling client can use it. Can go when upstream can load from a URL.
    """
    from datetime import datetime

    from sqlmodel import Session, create_engine
    from tx.tinker import types
    from tx.tinker.db_models import CheckpointDB, CheckpointStatus

    checkpoint_type = types.CheckpointType.TRAINING if kind == "state" else types.CheckpointType.SAMPLER
    engine = create_engine(database_url)
    try:
        with Session(engine) as session:
            session.merge(CheckpointDB(model_id=model_id, checkpoint_id=checkpoint_id, checkpoint_type=checkpoint_type,
                                       status=CheckpointStatus.COMPLETED, completed_at=datetime.now(UTC)))
            session.commit()
    finally:
        engine.dispose()


def model_lora(database_url: str, model_id: str) -> dict:
    """The LoRA config of a model the engine's database knows: rank, alpha, seed and the modules it trains."""
    from sqlmodel import Session, create_engine
    from tx.tinker.db_models import ModelDB

    engine = create_engine(database_url)
    try:
        with Session(engine) as session:
            row = session.get(ModelDB, model_id)
            if row is None:
                raise KeyError(f"the engine knows no model {model_id}")
            return dict(row.lora_config)
    finally:
        engine.dispose()
