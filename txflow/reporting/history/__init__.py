"""The nightly history: one record per nightly run under an fsspec root, and the
comparison of tonight's figures with the nights before.

Layout under the root (any fsspec URL: a local directory, `s3://...`, `memory://...`):

    <root>/records/<started_at, UTC, sortable>-<record id>.json

One object per record, never rewritten: two nightly runs that append at the same
moment write two different objects, so neither loses its record (no
read-modify-write of a shared file, which object stores cannot lock). Each object
is an envelope `{"format": 1, "sha256": ..., "record": {...}}` whose checksum
covers the record's canonical JSON, so a partly written or damaged object is
recognised on reading, reported, and skipped.

The figures of a night are a flat `dict[str, float]` keyed `<mode>.<figure>`
(`sft.final_eval_loss`, `rl.median_step_s`, `nightly.total_s`); `FIGURES`
declares for each key whether lower or higher is better and the smallest change
that counts, and `compare` judges every key by the same rule (see there).

Modules: `record` (the record and the figures of a run), `compare` (the rule), `store` (the objects
under the root) and `render` (markdown, table, trend plot). Pure functions of their inputs plus the
store: nothing here knows the flow.
"""

from txflow.reporting.history.compare import (
                                              FIGURES,
                                              KEY_FIGURES,
                                              MIN_HISTORY,
                                              WINDOW,
                                              Comparison,
                                              Figure,
                                              compare,
                                              regressions,
)
from txflow.reporting.history.record import (
                                              NightlyRecord,
                                              Versions,
                                              current_versions,
                                              figures_of,
                                              now,
                                              step_median,
)
from txflow.reporting.history.render import (
                                              markdown_summary,
                                              regression_message,
                                              table_rows,
                                              trend_png,
)
from txflow.reporting.history.store import (
                                              FORMAT,
                                              RECORDS_DIR,
                                              HistoryError,
                                              append,
                                              decode,
                                              encode,
                                              object_name,
                                              read,
)

__all__ = ["FIGURES", "FORMAT", "KEY_FIGURES", "MIN_HISTORY", "RECORDS_DIR", "WINDOW", "Comparison", "Figure",
           "HistoryError", "NightlyRecord", "Versions", "append", "compare", "current_versions", "decode", "encode",
           "figures_of", "markdown_summary", "now", "object_name", "read", "regression_message", "regressions",
           "step_median", "table_rows", "trend_png"]
