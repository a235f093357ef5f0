"""`txflow runs ROOT`: the runs under a checkpoints root, newest first, each with how it ended and where its
adapter is, from each run's report.json (a run without one is running or unfinished: its lease says which)."""

from __future__ import annotations

import json
import time

import fsspec

from txflow.checkpoints import retention


def list_runs(root: str, storage_options: dict | None = None) -> list[dict]:
    """One row per run under the checkpoints `root`, newest first (runs that never finished last). Raises
    ValueError when `root` holds no run (or is one run's root)."""
    options = storage_options or {}
    rows = []
    for run_root in retention.runs_under(root, options):
        fs, path = fsspec.core.url_to_fs(run_root, **options)
        row = {"run_id": run_root.rsplit("/", 1)[-1], "status": retention.run_status(run_root, options),
               "root": run_root, "mode": None, "base_model": None, "steps": None, "finished_at": None,
               "adapter": None, "error": None}
        try:  # read as plain JSON: a report of another txflow version still says these
            report = json.loads(fs.cat_file(f"{path.rstrip('/')}/{retention.REPORT}"))
        except (FileNotFoundError, ValueError):
            report = {}
        export = report.get("export") or {}
        row.update(mode=report.get("mode"), base_model=report.get("base_model"), steps=len(report.get("metrics") or [])
                   or None, finished_at=report.get("finished_at"),
                   adapter=export.get("peft_url") if export.get("passed") else None,
                   error=(report.get("error") or "").splitlines()[0] if report.get("error") else None)
        rows.append(row)
    return sorted(rows, key=lambda r: (r["finished_at"] is None, -(r["finished_at"] or 0)))


def table(rows: list[dict]) -> str:
    """The rows as the terminal shows them: one line per run."""
    lines = []
    for row in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(row["finished_at"])) if row["finished_at"] else "-"
        what = row["adapter"] or row["error"] or ""
        lines.append(f"{row['run_id']:24} {row['status']:10} {row['mode'] or '-':6} {row['base_model'] or '-':14} "
                     f"{row['steps'] or '-':>5} steps  {when:16}  {what}")
    return "\n".join(lines)
