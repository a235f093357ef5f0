"""Training progress: a terminal bar for the CLI, a progress artifact in Prefect."""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

PROGRESS_ENV = "TXFLOW_PROGRESS"


class StepProgress:
    """Reports `done / total` steps to every surface that is available."""

    def __init__(self, total: int, initial: int, run_id: str):
        self.total = total
        self.bar = tqdm(total=total, initial=initial, desc=f"train {run_id}", unit="step", file=sys.stderr,
                        disable=os.environ.get(PROGRESS_ENV) != "1", dynamic_ncols=True)
        self.artifact_id = None
        try:
            from prefect.artifacts import create_progress_artifact
            from prefect.context import TaskRunContext

            if TaskRunContext.get() is not None:
                self.artifact_id = create_progress_artifact(
                    progress=100.0 * initial / total, key=f"progress-{run_id.lower().replace('_', '-')}",
                    description=f"Training steps of run {run_id}",
                )
        except ImportError:
            pass

    def update(self, done: int, **postfix) -> None:
        self.bar.n = done
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)
        self.bar.refresh()
        if self.artifact_id is not None:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.artifact_id, progress=100.0 * done / self.total)

    def close(self) -> None:
        self.bar.close()
