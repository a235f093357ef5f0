"""Step 6, evaluate-restore: the saved checkpoints reproduce the live model, and the run reached the
quality bar of its mode (`txflow.training.restore` measures, `txflow.training.verdict` judges)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from txflow.cluster.handle import ClusterHandle
from txflow.cluster.monitor import retry_unless_cluster_fault
from txflow.config import RunConfig
from txflow.log import get_logger
from txflow.processes.holds import hold_point
from txflow.results import RestoreCheck, Saved
from txflow.training import restore


@task(name="evaluate-restore", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_cluster_fault,
      cache_policy=NO_CACHE)
def evaluate_restore(cfg: RunConfig, handle: ClusterHandle, metrics: list[dict], saved: Saved,
                     data) -> RestoreCheck:
    """Restore the state into a fresh training client and sample from the saved sampler weights."""
    get_logger().info(f"evaluate-restore: loading the committed checkpoints of run {cfg.run_id} from {cfg.run_root}")
    hold_point("evaluate-restore")  # a test's fault lands here (txflow.processes.holds)
    with handle.deaths_first():
        if cfg.mode == "custom":
            return restore.verify_client_checkpoints(cfg, handle, saved, data)
        return restore.restore_model_checkpoints(cfg, handle, metrics, saved, data)
