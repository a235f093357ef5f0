"""The run report: report.json and metrics.jsonl in the run root, Prefect artifacts."""

from __future__ import annotations

import base64
import io
import json
import time

import fsspec

from txflow.checkpoints.export import ExportResult, load_instructions
from txflow.checkpoints.promotion import Promotion
from txflow.cluster.monitor import Failure
from txflow.config import RunConfig
from txflow.log import scrub
from txflow.results import Discovered, Pruned, RestoreCheck, Saved, Trained


def build(cfg: RunConfig, status: str, error: str | None, timings: dict, metrics: list[dict],
          trained: Trained | None, saved: Saved | None, discovered: Discovered | None,
          restore: RestoreCheck | None, ranks: list[dict], failures: list[Failure],
          exported: ExportResult | None = None, pruned: Pruned | None = None,
          promoted: Promotion | None = None) -> dict:
    """The report of one run; every key is always present (None when the step did not run)."""
    return {
        "run_id": cfg.run_id,
        "mode": cfg.mode,
        "status": status,
        "error": scrub(error) if error else None,
        "num_processes": cfg.processes,
        "launcher": cfg.launcher,
        "base_model": cfg.base_model,
        "dataset": cfg.dataset,
        "learning_rate": cfg.learning_rate,
        "checkpoint_root": cfg.run_root,
        "state_dir": cfg.state_dir,
        "resumed_from_step": trained.resumed_from_step if trained else 0,
        "client_runs": trained.client_runs if trained and cfg.mode == "custom" else None,
        "metrics": metrics,
        "checkpoints": checkpoints_block(saved),
        "manifest": discovered.manifest if discovered else None,
        "artifacts": [a.model_dump() for a in discovered.artifacts] if discovered else [],
        "restore": restore.as_report() if restore else None,
        "live_reference_from_committed_state": saved.live.from_committed_state if saved and saved.live else None,
        "export": exported.model_dump() if exported else None,
        "retention": pruned.as_report() if pruned else None,
        "promotion": promoted.model_dump() if promoted else None,
        "timings_s": timings,
        "cluster": {"ranks": ranks},
        "failures": [{**f.as_dict(), "message": scrub(f.message)} for f in failures],
        "plot": None,
        "finished_at": time.time(),
    }


def checkpoints_block(saved: Saved | None) -> dict | None:
    """The last state and sampler checkpoint the run saved, and the list of all of them."""
    if not saved:
        return None
    all_ = [c.model_dump() for c in saved.checkpoints]
    block = {kind: next((c for c in reversed(all_) if c["kind"] == kind), None) for kind in ("state", "sampler")}
    block["all"] = all_
    return block


CURVES = {"nll": "loss (mean NLL per completion token)", "reward_mean": "mean reward"}


def _curve_key(metrics: list[dict]) -> str | None:
    return next((k for k in CURVES if metrics and k in metrics[0]), None)


def curve_png(metrics: list[dict]) -> bytes | None:
    """The loss (sft) or reward (rl) curve as a PNG, or None when the metrics have neither."""
    key = _curve_key(metrics)
    if key is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.add_subplot()
    ax.plot([m["step"] for m in metrics], [m[key] for m in metrics], marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel(CURVES[key])
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def write(cfg: RunConfig, report: dict, metrics_text: str) -> str:
    """Write report.json, metrics.jsonl and the curve into the run root; returns the report URL.

    A report.json already there (a run continued with --resume-from) is kept as report-<time>.json.
    """
    options = cfg.plain_storage_options()
    fs, path = fsspec.core.url_to_fs(cfg.run_root, **options)
    fs.makedirs(path, exist_ok=True)
    if fs.exists(f"{path}/report.json"):
        fs.copy(f"{path}/report.json", f"{path}/report-{int(time.time())}.json")
    png = curve_png(report["metrics"])
    if png is not None:
        fs.pipe_file(f"{path}/curve.png", png)
        report["plot"] = f"{cfg.run_root}/curve.png"
    fs.pipe_file(f"{path}/metrics.jsonl", metrics_text.encode())
    fs.pipe_file(f"{path}/report.json", json.dumps(report, indent=2).encode())
    return f"{cfg.run_root}/report.json"


def markdown(report: dict) -> str:
    restore = report["restore"] or {}
    metrics = report["metrics"]
    lines = [
        f"# txflow run `{report['run_id']}`: {report['status']}",
        "",
        f"- mode: **{report['mode']}**, {report['num_processes']} processes, base model `{report['base_model']}`",
        f"- steps: {len(metrics)}" + (f", learning rate {report['learning_rate']:g}" if report.get("learning_rate")
                                      else "") + (f", resumed from step {report['resumed_from_step']}"
                                      if report["resumed_from_step"] else ""),
    ]
    if metrics and "nll" in metrics[0]:
        lines.append(f"- loss (NLL/token): {metrics[0]['nll']:.4f} -> {metrics[-1]['nll']:.4f}")
    if metrics and "reward_mean" in metrics[0]:
        lines.append(f"- mean reward: {metrics[0]['reward_mean']:.4f} -> {metrics[-1]['reward_mean']:.4f}")
    if restore and "abs_diff" in restore:
        lines.append(
            f"- restore check: **{'passed' if restore.get('passed') else 'FAILED'}**; "
            f"loss {restore['loss_before']:.6f} live vs {restore['loss_after']:.6f} restored "
            f"(|diff| {restore['abs_diff']:.1e}); greedy tokens match: {restore['sampler_tokens_match']}")
    lines += [f"- failed check: **{check}**" for check in restore.get("failed_checks") or []]
    if restore and "eval_reward" in restore:
        lines.append(f"- eval reward: {restore['eval_reward']:.4f} saved sampler vs "
                     f"{restore['base_eval_reward']:.4f} base model")
    if restore and "checks" in restore:
        lines.append(f"- restore check of the client's checkpoints: "
                     f"**{'passed' if restore['passed'] else 'FAILED'}**")
        lines += [f"  - {c['kind']} `{c['tinker_path']}`: {'ok' if c['passed'] else 'FAILED ' + c.get('error', '')}"
                  for c in restore["checks"]]
    if report["checkpoints"]:
        for ckpt in report["checkpoints"]["all"]:
            lines.append(f"- {ckpt['kind']} checkpoint: `{ckpt['tinker_path']}` at `{ckpt['url']}`")
    if report["manifest"]:
        lines.append(f"- manifest: `{report['manifest']}` ({len(report['artifacts'])} artifacts)")
    if report.get("plot"):
        lines.append(f"- curve: `{report['plot']}`")
    png = curve_png(metrics)
    if png is not None:  # inline: the Prefect UI shows a data URI, and cannot open a path in the run root
        lines += ["", f"![{CURVES[_curve_key(metrics)]}](data:image/png;base64,{base64.b64encode(png).decode()})"]
    lines += export_markdown(report.get("export"))
    lines += lifecycle_markdown(report)
    if (report.get("client_runs") or 0) > 1:
        lines.append(f"- the custom client ran {report['client_runs']} times: a cluster fault re-ran it from the start")
    if report["failures"]:
        lines += ["", "## Failures recovered or not", ""]
        for f in report["failures"]:
            who = f"rank {f['rank']} ({f['role']})" if f["rank"] is not None else f["role"]
            when = time.strftime('%H:%M:%S', time.localtime(f['detected_at']))
            lines.append(f"- {who}, exit code {f['exit_code']}, detected at {when}"
                         + (f" during {f['step']}" if f.get("step") else "")
                         + (f"; the retry resumed at {f['resumed_at']}" if f.get("resumed_at") else "")
                         + (f" from step {f['resumed_from_step']}" if f["resumed_from_step"] is not None else ""))
    if report["error"]:
        lines += ["", "## Error", "", "```", report["error"][-3000:], "```"]
    lines += ["", "## Timings (s)", ""] + [f"- {k}: {v:.1f}" for k, v in report["timings_s"].items()]
    return "\n".join(lines)


def lifecycle_markdown(report: dict) -> list[str]:
    """What prune-checkpoints deleted and what became of the promotion."""
    lines = []
    retention = report.get("retention")
    if retention:
        lines += ["", "## Retention", "",
                  f"- kept the newest {retention['keep_last']} periodic states; {len(retention['deleted'])} deleted, "
                  f"{retention['bytes_freed']:,} bytes freed"]
        lines += [f"  - `{d['url']}` ({d['bytes']:,} bytes): {d['reason']}" for d in retention["deleted"]]
    promoted = report.get("promotion")
    if promoted:
        lines += ["", "## Promotion", ""]
        if promoted["status"] == "promoted":
            lines += [f"- promoted as **{promoted['name']}**: `{promoted['url']}` (pointer `{promoted['pointer']}`; "
                      f"`txflow promoted <checkpoints> {promoted['name']}` shows it)"]
        else:
            lines += [f"- **not promoted** as {promoted['name']}: {promoted['status']}"]
        if promoted.get("comment"):
            lines.append(f"- approver's comment: {promoted['comment']}")
    return lines


def approval_markdown(cfg: RunConfig, metrics: list[dict], restore: RestoreCheck, exported: ExportResult) -> str:
    """What the person approving sees in the Prefect UI: the figures the promotion would publish."""
    last = {k: v for k, v in (metrics[-1] if metrics else {}).items() if k != "step"}
    figures = {**last, **restore.quality, "restore |loss diff|": restore.abs_diff,
               "export max |Δ logprob|": exported.max_abs_logprob_diff}
    rows = [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in figures.items()
            if v is not None]
    return "\n".join([f"Promote run `{cfg.run_id}` ({cfg.mode}, {len(metrics)} steps, base model `{cfg.base_model}`) "
                      f"as **{cfg.promote_as}**? Every check passed.", "", "| figure | value |", "|---|---|", *rows,
                      "", f"Adapter: `{exported.peft_url}`; report: `{cfg.run_root}/report.json`"])


def export_markdown(block: dict | None) -> list[str]:
    """The export's figures in the markdown report, and how to load what it wrote."""
    if not block:
        return []
    verdict = "passed" if block["passed"] else "FAILED"
    lines = ["", "## Exported adapter", "",
             f"- proof: **{verdict}**: transformers + peft reproduce SkyRL's restored sampler with max |Δ logprob| "
             f"{block['max_abs_logprob_diff']:.2e} (bound {block['logprob_bound']:g}), greedy tokens match: "
             f"{block['greedy_tokens_match']}",
             f"- source: `{block['sampler_url']}`; LoRA r {block['r']}, alpha {block['lora_alpha']:g} on "
             f"{', '.join(block['target_modules'])}"]
    if block.get("problem"):
        lines.append(f"- problem: {block['problem']}")
    if block.get("peft_url"):
        lines.append(f"- PEFT adapter: `{block['peft_url']}`")
    if block.get("merged_url"):
        lines.append(f"- merged model: `{block['merged_url']}` (max |Δ logprob| "
                     f"{block['merged_max_abs_logprob_diff']:.2e} against the PEFT model, greedy tokens match: "
                     f"{block['merged_greedy_tokens_match']})")
    lines += [f"- note: {note}" for note in block.get("notes") or []]
    if block.get("peft_url"):
        lines += ["", "Load the adapter (the directory copied locally):", "",
                  load_instructions(block["base_model"], merged=False)]
    return lines


def publish_artifacts(report: dict) -> None:
    """Markdown summary and per-step metrics table on the Prefect flow run (when there is one)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return
    key = report["run_id"].lower().replace("_", "-")
    create_markdown_artifact(markdown(report), key=f"report-{key}", description="txflow run report")
    if report["metrics"]:
        create_table_artifact(report["metrics"], key=f"metrics-{key}", description="Per-step training metrics")
