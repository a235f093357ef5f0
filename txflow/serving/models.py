"""What `txflow serve` serves: the cluster's base model, and each named adapter, a run's checked sampler
checkpoint copied back from its durable URL into an adapter slot of the serving process's own."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from txflow.checkpoints import export, storage
from txflow.cluster import named
from txflow.cluster.handle import ClusterHandle
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.training.clients import lora_client
from txflow.training.tokenizer import load_tokenizer


@dataclass
class Served:
    """One name `model` may take, and its sampling client (the serving key's release unloads its slot)."""

    name: str
    sampler: object


@dataclass
class Serving:
    """The cluster a serving process is attached to, and what it serves by name."""

    cfg: RunConfig
    handle: ClusterHandle
    tokenizer: object
    models: dict[str, Served] = field(default_factory=dict)
    timeout_s: float = 300.0


def parse_adapters(pairs: list[str]) -> dict[str, str]:
    """`NAME=URL` pairs (URL: a run root, or its checked sampler checkpoint): {name: url}; ValueError in one
    line for a malformed or repeated name."""
    adapters = {}
    for pair in pairs:
        name, sep, url = pair.partition("=")
        if not sep or not name or not url or any(c.isspace() or c == "/" for c in name):
            raise ValueError(f"--adapter {pair!r}: give NAME=URL, a name without spaces or slashes and a run root "
                             f"(or its sampler checkpoint)")
        if name in adapters:
            raise ValueError(f"--adapter {name}: given twice")
        adapters[name] = url
    return adapters


def references(adapters: dict[str, str], options: dict) -> dict[str, export.ExportReference]:
    """Each adapter's checked sampler (what evaluate-restore recorded), before anything is attached: a URL that
    is not a run with a checked, committed sampler is refused here in one line."""
    found = {}
    for name, url in adapters.items():
        try:
            _, reference = export.locate(url, options)
        except export.ExportError as exc:
            raise ValueError(f"--adapter {name}: {exc}") from None
        if reference.lora is None:
            raise ValueError(f"--adapter {name}: {url} was checked by an older txflow that did not record the "
                             f"adapter's slot (rank, modules); run `txflow run` again to serve it")
        found[name] = reference
    return found


def attach(cluster: str, options: dict[str, str], state_dir: Path, timeout_s: float) -> Serving:
    """A key of its own on the warm cluster `cluster` (as an attached run has), and its tokenizer."""
    serves = named.load_serves(cluster)
    if serves is None:
        raise ValueError(f"--cluster {cluster}: no such cluster under {named.clusters_dir()}; start one with "
                         f"`txflow cluster up {cluster}`")
    cfg = named.attached_config(RunConfig(
        mode="sft", base_model=serves.base_model, cluster=cluster, run_id=f"serve-{secrets.token_hex(4)}",
        state_dir=str(state_dir), storage_options=options, startup_timeout_s=timeout_s, step_timeout_s=timeout_s))
    handle = named.attach(cfg, serves.base_model_path)
    try:
        named.verify(cfg, handle)
        tokenizer = load_tokenizer(handle.cluster.base_model_path)
    except BaseException:
        handle.stop()
        raise
    return Serving(cfg=cfg, handle=handle, tokenizer=tokenizer, timeout_s=timeout_s)


def load(serving: Serving, references_by_name: dict[str, export.ExportReference]) -> None:
    """The base model under the cluster's name for it, and each adapter in a slot of its rank and modules."""
    cfg, handle = serving.cfg, serving.handle
    client = handle.service_client()
    base = named.load_serves(cfg.cluster).base_model
    serving.models[base] = Served(base, handle.base_sampler(client))
    for name, reference in references_by_name.items():
        lora = reference.lora
        modules = {k: bool(lora.get(k)) for k in ("train_attn", "train_mlp", "train_unembed")}
        slot = lora_client(handle, client, int(lora["rank"]), serving.timeout_s, modules=modules)
        path = storage.import_checkpoint(cfg, handle.cluster.checkpoints_base, reference.sampler_url, "sampler",
                                         slot.model_id, "served")
        serving.models[name] = Served(name, client.create_sampling_client(model_path=path))
        get_logger().info(f"serving {name}: {reference.sampler_url} (rank {lora['rank']})")


def release(serving: Serving) -> None:
    """Unload what was loaded and give the key back; the cluster stays up."""
    serving.handle.stop()
