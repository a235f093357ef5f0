"""`txflow runs`, `discover`, `export`, `prune` and `promoted`: a run's artifacts, through `txflow.artifacts` as the
flow's steps use it."""

from __future__ import annotations

import json
import re
import sys
import time

from txflow.cli.options import command_storage_options
from txflow.config import PROMOTION_NAME_PATTERN
from txflow.log import scrub


def prune_cmd(args) -> int:
    """`txflow prune ROOT`: 0 when done (or, dry, planned), 2 on bad input (nothing deleted)."""
    from txflow.artifacts import prune

    try:
        options = command_storage_options(args.storage_option)
        runs, trimmed = prune.root(args.root, args.keep_last, args.older_than, options, dry_run=args.dry_run,
                                   include_failed=args.include_failed)
    except ValueError as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    freed = sum(run.bytes_freed for run in runs)
    if args.json:
        json.dump({"dry_run": args.dry_run, "bytes_freed": freed,
                   "runs": [{**run.model_dump(), "bytes_freed": run.bytes_freed} for run in runs],
                   "promotions_removed": trimmed}, sys.stdout, indent=2)
        print()
    verb = "would delete" if args.dry_run else "deleted"
    out = sys.stderr if args.json else sys.stdout  # with --json, stdout carries the JSON alone
    for run in runs:
        if run.skipped:
            print(f"{run.run_id}: skipped, {run.skipped}", file=out)
        for deletion in run.deletions:
            print(f"{run.run_id}: {verb} {deletion.url} ({deletion.bytes:,} bytes): {deletion.reason}", file=out)
    for url in trimmed:
        print(f"deleted {url}: an older promotion", file=out)
    count = sum(len(run.deletions) for run in runs)
    print(f"txflow: {verb} {count} checkpoints of {len(runs)} runs, {freed:,} bytes"
          + (" would be freed" if args.dry_run else " freed"), file=sys.stderr)
    return 0


def promoted_cmd(args) -> int:
    """`txflow promoted ROOT NAME`: the current promotion and its history; 1 when nothing is promoted."""
    from txflow.checkpoints import promotion

    try:
        if not re.fullmatch(PROMOTION_NAME_PATTERN, args.name):
            raise ValueError(f"{args.name!r} is no promotion name (1-64 letters, digits, '.', '-' or '_')")
        options = command_storage_options(args.storage_option)
        current = promotion.current(args.root, args.name, options)
        kept = promotion.history(args.root, args.name, options)
    except ValueError as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    if args.json:
        json.dump({"current": current, "history": kept}, sys.stdout, indent=2)
        print()
    if current is None:
        print(f"txflow: nothing is promoted as {args.name!r} under {args.root}", file=sys.stderr)
        return 1
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(current["promoted_at"]))
    lines = [f"{args.name}: run {current['run_id']} ({current['mode']}, base model {current['base_model']}), "
             f"promoted {when}", f"  adapter: {current['files']['peft']}"]
    if "merged" in current["files"]:
        lines.append(f"  merged model: {current['files']['merged']}")
    lines += [f"  {k}: {v:.6g}" if isinstance(v, float) else f"  {k}: {v}" for k, v in current["figures"].items()]
    if current.get("approver"):
        lines.append(f"  approved by: {current['approver']}")
    if current.get("approval_comment"):
        lines.append(f"  approved: {current['approval_comment']}")
    lines.append("  history: " + ", ".join(f"{r['id']} (run {r['run_id']})" for r in kept if r["id"] != current["id"])
                 if len(kept) > 1 else "  history: none before it")
    print("\n".join(lines), file=sys.stderr if args.json else sys.stdout)
    return 0


def runs_cmd(args) -> int:
    """`txflow runs ROOT`: 0 with one line per run, 2 on bad input (no run there)."""
    from txflow.reporting.runs import list_runs, table

    try:
        rows = list_runs(args.root, command_storage_options(args.storage_option))
    except (FileNotFoundError, ValueError) as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


def discover_cmd(args) -> int:
    """`txflow discover URL`: 0 when every artifact is complete, 1 when one is not, 2 on bad input (nothing
    there, a URL or storage option that does not serve), as every command."""
    from txflow.artifacts import discover

    try:
        artifacts = discover.url(args.url, command_storage_options(args.storage_option),
                                 require_commit=args.require_commit)
    except (FileNotFoundError, NotADirectoryError, ValueError) as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    if args.json:
        json.dump([a.model_dump() for a in artifacts], sys.stdout, indent=2)
        print()
    else:
        for a in artifacts:
            state = "complete" if a.complete else f"INCOMPLETE: {a.reason}"
            files = a.files if a.files is not None else "-"
            print(f"{a.kind:8} {a.format:9} {a.bytes:>12} B {files:>5} files  {a.url}  [{state}]")
    return 0 if all(a.complete for a in artifacts) else 1


def export_cmd(args) -> int:
    """`txflow export URL --to DIR`: 0 when the export is written and proven, 1 when its proof fails (nothing
    is written), 2 on bad input (nothing is started)."""
    from txflow.artifacts import export
    from txflow.checkpoints.export import ExportError, failure

    try:
        result = export.url(args.url, args.to, command_storage_options(args.storage_option), args.base_model,
                            merged=args.merged, force=args.force,
                            log=lambda line: print(f"txflow: {line}", file=sys.stderr))
    except (ExportError, ValueError) as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(result.model_dump(), sys.stdout, indent=2)
        print()
    problem = failure(result)
    if problem:
        print(f"txflow: export check failed: {problem}; nothing was written to {args.to}", file=sys.stderr)
        return 1
    print(f"txflow: exported {result.peft_url}" + (f" and {result.merged_url}" if result.merged_url else "")
          + f", proven: max |Δ logprob| {result.max_abs_logprob_diff:.2e}, greedy tokens match", file=sys.stderr)
    return 0
