"""The training bar: a terminal progress bar for the CLI, a progress artifact in Prefect.

The artifact is updated off the training loop's critical path: a request to the
Prefect API per step would add its latency to every step, so a background
thread sends the latest value at most once a second (updates in between
coalesce), and `close` sends the last one at once.
"""

from __future__ import annotations

import contextvars
import os
import sys
import threading

from tqdm import tqdm

from txflow.log import get_logger

PROGRESS_ENV = "TXFLOW_PROGRESS"
MIN_INTERVAL_S = 1.0


class TrainingBar:
    """Reports `done / total` steps to every surface that is available."""

    def __init__(self, total: int, initial: int, run_id: str):
        self.total = total
        self.bar = tqdm(total=total, initial=initial, desc=f"train {run_id}", unit="step", file=sys.stderr,
                        disable=os.environ.get(PROGRESS_ENV) != "1", dynamic_ncols=True)
        self.artifact_id = None
        self._latest: float | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._sender = None
        try:
            from prefect.artifacts import create_progress_artifact
            from prefect.context import TaskRunContext

            if TaskRunContext.get() is not None:
                self.artifact_id = create_progress_artifact(
                    progress=100.0 * initial / total, key=f"progress-{run_id.lower().replace('_', '-')}",
                    description=f"Training steps of run {run_id}",
                )
                # The sender runs in this context: its Prefect settings (the API this run reports to) are
                # contextvars, which a bare thread would not see (a sweep's members run in threads).
                self._sender = threading.Thread(target=contextvars.copy_context().run, args=(self._send_latest,),
                                                name="txflow-progress", daemon=True)
                self._sender.start()
        except ImportError:
            pass

    def update(self, done: int, **postfix) -> None:
        self.bar.n = done
        if postfix:
            self.bar.set_postfix(postfix, refresh=False)
        self.bar.refresh()
        if self._sender is not None:
            with self._wake:
                self._latest = 100.0 * done / self.total
                self._wake.notify()

    def _send_latest(self) -> None:
        from prefect.artifacts import update_progress_artifact

        while True:
            with self._wake:
                while self._latest is None and not self._closed:
                    self._wake.wait()
                value, self._latest = self._latest, None
                closed = self._closed
            if value is not None:
                try:
                    update_progress_artifact(self.artifact_id, progress=value)
                except Exception as exc:  # the bar in the UI lags; training does not stop for it
                    get_logger().warning(f"progress artifact not updated: {exc}")
                # At most one update a second: each costs the Prefect server CPU that the ranks share.
                with self._wake:
                    self._wake.wait_for(lambda: self._closed, timeout=MIN_INTERVAL_S)
            if closed and value is None:
                return

    def close(self) -> None:
        self.bar.close()
        if self._sender is not None:
            with self._wake:
                self._closed = True
                self._wake.notify()
            self._sender.join(timeout=30)  # the last value reaches the UI before the step ends
