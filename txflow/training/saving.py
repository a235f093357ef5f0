"""What save-checkpoint does on a running cluster: the final training state (committed by the train step
at its last step, with the live model's figures recorded just before) and the sampler weights under the
run root, made durable and committed; in custom mode, every checkpoint the client saved."""

from __future__ import annotations

from pathlib import Path

from txflow.checkpoints import storage
from txflow.checkpoints.discovery import discover
from txflow.checkpoints.names import checkpoint_name
from txflow.cluster import named
from txflow.cluster.handle import ClusterHandle
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.processes.holds import hold_point
from txflow.results import Checkpoint, Saved, Trained
from txflow.training.clients import training_client_at
from txflow.upstream.skyrl_tx import layout


def save_client_checkpoints(cfg: RunConfig, handle: ClusterHandle) -> Saved:
    """custom mode: the client saved what it wanted; commit every complete checkpoint it left in staging (this
    attempt's: the staging directory is emptied for every cluster)."""
    checkpoints = []
    base = handle.cluster.checkpoints_base
    # On a shared cluster the staging holds every run's saves: only the models the run's key created are its.
    mine = set(named.owned(handle)["models"]) if handle.shared else None
    for artifact in discover(base):
        path = layout.tinker_path_for(artifact.path)
        if artifact.kind not in ("state", "sampler") or not path or layout.is_ephemeral_sampler(artifact.path):
            continue
        if mine is not None and layout.parse_tinker_path(path)[0] not in mine:
            continue
        if not artifact.complete:  # a save the client did not finish (staging is fresh for every attempt)
            get_logger().warning(f"not committing {path}: {artifact.reason}")
            continue
        checkpoints.append(Checkpoint(kind=artifact.kind, tinker_path=path, url=storage.commit(cfg, base, path),
                                      saved_at=(Path(base) / artifact.path).stat().st_mtime))
    if not checkpoints:
        raise FileNotFoundError(f"The custom client saved no checkpoint (nothing under {base})")
    return Saved(checkpoints=checkpoints)


def live_client(cfg: RunConfig, handle: ClusterHandle, trained: Trained):
    """A client of the trained model on `handle`, to write its sampler weights from: the live client, or,
    when training ran on a cluster that has since failed, a fresh one holding the committed final state
    (the same weights; the live model's figures were recorded before that commit)."""
    if trained.handle is handle:
        return trained.training_client
    step = storage.step_of(trained.final_state.url)
    get_logger().info(f"save-checkpoint resumes on a fresh cluster from the committed final state of step {step} "
                      f"({trained.final_state.url}); training does not run again")
    return training_client_at(cfg, handle, (trained.final_state.url, step))


def save_model_checkpoints(cfg: RunConfig, handle: ClusterHandle, trained: Trained) -> Saved:
    """sft and rl: the sampler weights of the final step, committed beside the final state."""
    log = get_logger()
    step = storage.step_of(trained.final_state.url)
    log.info(f"save-checkpoint: saving the sampler weights of step {step}")
    hold_point("save-checkpoint")  # a test's fault lands here (txflow.processes.holds)
    client = live_client(cfg, handle, trained)
    timeout = cfg.step_timeout_s
    name = checkpoint_name(step)
    sampler_path = handle.wait(client.save_weights_for_sampler(name), "save_weights_for_sampler", timeout).path
    # The sampling clients of training wrote transient sampler weights next to the real ones.
    storage.remove_ephemeral_samplers(handle.cluster.checkpoints_base, client.model_id if handle.shared else None)
    sampler = Checkpoint(kind="sampler", tinker_path=sampler_path,
                         url=storage.commit(cfg, handle.cluster.checkpoints_base, sampler_path))
    checkpoints = [trained.final_state, sampler]
    log.info("saved and committed " + "; ".join(f"{c.kind} {c.tinker_path} -> {c.url}" for c in checkpoints))
    return Saved(checkpoints=checkpoints, live=trained.live)


def save(cfg: RunConfig, handle: ClusterHandle, trained: Trained) -> Saved:
    """Save the sampler weights, commit them to the run root, and record where everything lives."""
    if cfg.mode == "custom":
        return save_client_checkpoints(cfg, handle)
    return save_model_checkpoints(cfg, handle, trained)
