"""The training loop of the sft and rl modes, and the custom client's run: what the train step does on a
running cluster. Periodic `save_state`, committed to the run root, and a save at the last step, so a retry
resumes from the last durable step and no step after training ever needs to train again."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import fsspec

from txflow.checkpoints import lease, storage
from txflow.checkpoints.names import checkpoint_name
from txflow.cluster.handle import ClusterHandle
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.processes.holds import hold_point
from txflow.reporting.bar import TrainingBar
from txflow.reporting.metrics import append_metric, read_metrics, write_metrics
from txflow.reporting.report import publish_metrics
from txflow.results import Checkpoint, LiveReference, Trained
from txflow.training import custom, datasets, evaluation, rl, sft
from txflow.training.clients import sampling_client_of, training_client_at
from txflow.upstream.skyrl_tx.losses import DEFAULTS as LOSS_DEFAULTS

# rl sends ppo no loss_fn_config: its ratio is clipped at the default thresholds.
PPO_CLIP = (LOSS_DEFAULTS["ppo"]["clip_low_threshold"], LOSS_DEFAULTS["ppo"]["clip_high_threshold"])


# The Prefect UI's metrics table is published this many times while a run trains (every step of a short run),
# then once more with the report: often enough to watch, few enough versions for a run of thousands of steps.
LIVE_TABLES = 20


def resume_point(cfg: RunConfig) -> tuple[str, int] | None:
    """(URL, step) of the state to continue from: this run's latest committed state (a retry),
    else the one `--resume-from` names, else None."""
    options = cfg.plain_storage_options()
    own = storage.latest_state(cfg.run_root, options)
    if own is not None:
        return own.url, storage.step_of(own.path)
    return storage.resolve_resume_from(cfg) if cfg.resume_from else None


def save_progress(cfg: RunConfig, handle: ClusterHandle, training_client, step: int) -> Checkpoint:
    """save_state at `step` and commit it to the run root, so that a retry resumes there."""
    future = training_client.save_state(checkpoint_name(step))
    saved = handle.wait(future, f"save_state at step {step}", cfg.step_timeout_s)
    url = storage.commit(cfg, handle.cluster.checkpoints_base, saved.path)
    get_logger().info(f"saved state at step {step}: {url}")
    return Checkpoint(kind="state", tinker_path=saved.path, url=url)


def sft_step(cfg: RunConfig, handle: ClusterHandle, data: sft.SFTData):
    """One SFT step: cross-entropy on a batch; returns its metrics."""
    from txflow.upstream.tinker_sdk import tinker

    adam = tinker.types.AdamParams(learning_rate=cfg.learning_rate)

    def step_fn(training_client, step: int) -> dict:
        batch = [data.train[i] for i in datasets.batch_indices(len(data.train), step, cfg.batch_size, cfg.seed)]
        # Both requests in flight before either is awaited, as the Tinker cookbook does.
        fwd_bwd = training_client.forward_backward(sft.averaged([sft.to_datum(e) for e in batch]), "cross_entropy")
        optim = training_client.optim_step(adam)
        output = handle.wait(fwd_bwd, f"forward_backward of step {step + 1}", cfg.step_timeout_s)
        handle.wait(optim, f"optim_step of step {step + 1}", cfg.step_timeout_s)
        nll, tokens = sft.mean_nll(output, batch)
        return {"nll": nll, "tokens": tokens}

    return step_fn


def rl_step(cfg: RunConfig, handle: ClusterHandle, data: rl.RLData):
    """One RL step: sample groups with the current policy, score, update; returns its metrics."""
    from txflow.upstream.tinker_sdk import tinker

    adam = tinker.types.AdamParams(learning_rate=cfg.learning_rate)

    def step_fn(training_client, step: int) -> dict:
        policy = sampling_client_of(handle, training_client, cfg.step_timeout_s)
        indices = datasets.batch_indices(len(data.prompts), step, cfg.batch_size, cfg.seed)
        groups = rl.sample_groups(policy, data, indices, cfg.rl.group_size, cfg.rl.max_tokens, cfg.rl.temperature,
                                  cfg.seed * 100_003 + step, handle, cfg.step_timeout_s)
        # One optimizer step per minibatch, all in flight: the engine runs a model's requests in order.
        batches = [sft.averaged(batch) for batch in rl.minibatches(rl.to_datums(groups, data), cfg.rl.substeps)]
        pending = [(batch, training_client.forward_backward(batch, cfg.rl.loss), training_client.optim_step(adam))
                   for batch in batches]
        clipped = counted = 0
        for i, (batch, fwd_bwd, optim) in enumerate(pending):
            output = handle.wait(fwd_bwd, f"forward_backward {i + 1} of step {step + 1}", cfg.step_timeout_s)
            handle.wait(optim, f"optim_step {i + 1} of step {step + 1}", cfg.step_timeout_s)
            found = rl.clip_fraction(batch, output.loss_fn_outputs, *PPO_CLIP)
            clipped, counted = clipped + found[0], counted + found[1]
        rewards = rl.rewards_of(groups)
        row = {"reward_mean": statistics.fmean(rewards), "reward_std": statistics.pstdev(rewards),
               "tokens_sampled": sum(len(r.tokens) for g in groups for r in g)}
        if cfg.rl.loss == "ppo":
            row["clip_fraction"] = clipped / counted if counted else 0.0
        return row

    return step_fn


STEPS = {"sft": sft_step, "rl": rl_step}


def train_loop(cfg: RunConfig, handle: ClusterHandle, step_fn, data) -> Trained:
    """Steps from the resume point to `cfg.steps`: metrics per step, a durable save every `save_every`
    and at the last step, and the live model's figures (`LiveReference`) just before that last save."""
    log = get_logger()
    point = resume_point(cfg)
    start = point[1] if point else 0
    training_client = training_client_at(cfg, handle, point)  # a resume restores the optimizer too
    if point:
        log.info(f"resumed from step {start}: {point[0]}")
    metrics = read_metrics(cfg.state_dir, up_to_step=start)
    write_metrics(cfg.state_dir, metrics)
    final = live = None
    if point and start >= cfg.steps:  # the last step was already committed (a fault after it)
        final = Checkpoint(kind="state", tinker_path=storage.tinker_path_of(cfg, point[0]), url=point[0])
        live = read_live_reference(cfg)
        if live is None:  # written before the final commit, so only a hand-edited root lacks it
            raise FileNotFoundError(f"{cfg.run_root}/{LIVE_REFERENCE} is missing: the live model's figures, which "
                                    f"the restore check compares the committed state of step {start} with")
    bar = TrainingBar(cfg.steps, start, cfg.run_id)
    live_every = max(1, cfg.steps // LIVE_TABLES)
    try:
        for step in range(start, cfg.steps):
            lease.check(cfg.run_root, cfg.plain_storage_options())  # taken over (it looked dead): stop here
            began = time.monotonic()
            row = {"step": step + 1, **step_fn(training_client, step), "seconds": 0.0}
            row["seconds"] = round(time.monotonic() - began, 3)
            metrics.append(row)
            append_metric(cfg.state_dir, row)
            values = " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in row.items() if k != "step")
            log.info(f"step {step + 1}/{cfg.steps} {values}")
            headline = next(k for k in row if k != "step")
            bar.update(step + 1, **{headline: f"{row[headline]:.3f}"})
            if (step + 1) % live_every == 0 and step + 1 < cfg.steps:  # the last: with the report, at the end
                publish_metrics(cfg.run_id, metrics)
            if step + 1 == cfg.steps:
                # The live model's figures first, kept with the run: every later attempt (a fault after
                # this) compares the committed copies with them, never the committed state with itself.
                live = evaluation.live_reference(cfg.mode, handle, training_client, data, cfg.step_timeout_s,
                                                 cfg.seed)
                write_live_reference(cfg, live)
                final = save_progress(cfg, handle, training_client, step + 1)
            elif cfg.save_every and (step + 1) % cfg.save_every == 0:
                save_progress(cfg, handle, training_client, step + 1)
            hold_point(f"train-step-{step + 1}")  # a test's fault lands here (txflow.processes.holds)
    finally:
        bar.close()
    return Trained(metrics=metrics, final_state=final, resumed_from_step=start, training_client=training_client,
                   handle=handle, live=live)


LIVE_REFERENCE = "live-reference.json"


def write_live_reference(cfg: RunConfig, live: LiveReference) -> None:
    fs, root = fsspec.core.url_to_fs(cfg.run_root, **cfg.plain_storage_options())
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/{LIVE_REFERENCE}", live.model_dump_json().encode())


def read_live_reference(cfg: RunConfig) -> LiveReference | None:
    fs, root = fsspec.core.url_to_fs(cfg.run_root, **cfg.plain_storage_options())
    try:
        return LiveReference.model_validate_json(fs.cat_file(f"{root}/{LIVE_REFERENCE}"))
    except FileNotFoundError:
        return None


def train_custom(cfg: RunConfig, handle: ClusterHandle, data: custom.CustomData, attempt: int) -> Trained:
    log = get_logger()
    values = {"base_url": handle.cluster.base_url, "base_model": handle.cluster.base_model_path,
              "run_id": cfg.run_id, "checkpoint_root": cfg.run_root}
    command = data.command + custom.fill(cfg.custom.client_args, values)
    if attempt > 1:
        log.warning(f"re-running the custom client from the start (run {attempt}): a cluster fault interrupted "
                    f"it, and only the client knows how to resume")
    log.info(f"custom client: {' '.join(command)}")
    log_path = Path(cfg.state_dir) / "logs" / "client.log"
    seconds = custom.run_client(command, custom.client_env(handle.cluster), log_path, handle, log.info)
    log.info(f"custom client finished in {seconds:.1f} s")
    return Trained(metrics=[{"step": 1, "seconds": round(seconds, 3)}], final_state=None, client_runs=attempt,
                   handle=handle)


def train(cfg: RunConfig, handle: ClusterHandle, data, attempt: int = 1) -> Trained:
    """Run the training of `cfg.mode` against the cluster; `attempt` counts the runs of this step."""
    if cfg.mode == "custom":
        return train_custom(cfg, handle, data, attempt)
    return train_loop(cfg, handle, STEPS[cfg.mode](cfg, handle, data), data)
