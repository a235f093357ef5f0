"""The run report: `RunReport` (report.json), metrics.jsonl in the run root, Prefect artifacts."""

from __future__ import annotations

import base64
import io
import time
from typing import Any, Literal

import fsspec
from pydantic import BaseModel, Field

from txflow.checkpoints.discovery import Artifact
from txflow.checkpoints.export import ExportResult, load_instructions, noise_note
from txflow.checkpoints.promotion import Promotion
from txflow.config import RunConfig
from txflow.log import get_logger, scrub
from txflow.reporting.metrics import read_metrics
from txflow.results import Progress, RestoreCheck, Saved, step_name


class RunReport(BaseModel):
    """What one run did, as report.json holds it and `txflow run --json` prints it: every key is always
    present (None, or empty, when its step did not run). Readers parse it with `RunReport.read`."""

    run_id: str
    mode: str
    status: Literal["passed", "failed"]
    error: str | None = Field(description="Why the run failed, credentials masked; None when it passed")
    num_processes: int
    launcher: str
    base_model: str
    dataset: str | None
    eval_dataset: str | None = Field(default=None, description="The held-out rows' dataset (sft); None: the last "
                                     "tenth of `dataset`")
    learning_rate: float | None = Field(default=None, description="The Adam learning rate the run trained with "
                                        "(given, or derived from the model)")
    checkpoint_root: str
    state_dir: str
    resumed_from_step: int = 0
    client_runs: int | None = Field(default=None, description="custom mode: how many times the client ran")
    metrics: list[dict[str, Any]]
    checkpoints: dict[str, Any] | None = Field(description="The last state and sampler checkpoint, and `all`")
    manifest: str | None
    artifacts: list[Artifact]
    restore: dict[str, Any] | None = Field(description="evaluate-restore's checks, the quality figures flattened in")
    evaluation: dict[str, Any] | None = Field(
        default=None, description="The evaluate step's (`eval_task`): the harness, the task, each model's score")
    export: ExportResult | None
    retention: dict[str, Any] | None
    promotion: Promotion | None
    timings_s: dict[str, float] = Field(description="Seconds per step, by the step's name, and `total`")
    cluster: dict[str, list[dict[str, Any]]] = Field(description="`ranks`: each process as teardown left it")
    failures: list[dict[str, Any]]
    plot: str | None = None
    finished_at: float

    @classmethod
    def read(cls, text: str | bytes) -> RunReport:
        return cls.model_validate_json(text)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def seconds(self, *steps) -> float:
        """The seconds the given steps (Prefect tasks, functions or names) took, added up (0 for one that did
        not run)."""
        return sum(self.timings_s.get(s if isinstance(s, str) else step_name(s), 0.0) for s in steps)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


class Outcome(BaseModel):
    """How a run ended, as every report.json says it, whatever else it holds (a report of another txflow
    version, or a partial one): what pre-flight needs to refuse a run id that was used."""

    status: str
    error: str | None = None

    @classmethod
    def read(cls, text: str | bytes) -> Outcome:
        return cls.model_validate_json(text)


def run_metrics(cfg: RunConfig, progress: Progress) -> list[dict]:
    """The metrics of every step trained, by this attempt or, when training did not finish, from the state dir."""
    return progress.trained.metrics if progress.trained else read_metrics(cfg.state_dir)


def build(cfg: RunConfig, progress: Progress, error: str | None) -> RunReport:
    """The report of one run from what its steps produced; it passed when nothing failed and the restore
    check passed. Every text in it is scrubbed: the dataset and every URL as much as the error."""
    trained, saved, discovered, restore = progress.trained, progress.saved, progress.discovered, progress.restore
    passed = error is None and restore is not None and restore.passed
    report = RunReport(
        run_id=cfg.run_id,
        mode=cfg.mode,
        status="passed" if passed else "failed",
        error=scrub(error) if error else None,
        num_processes=cfg.processes,
        launcher=cfg.launcher,
        base_model=cfg.base_model,
        dataset=cfg.dataset,
        eval_dataset=cfg.eval_dataset,
        learning_rate=cfg.learning_rate,
        checkpoint_root=cfg.run_root,
        state_dir=cfg.state_dir,
        resumed_from_step=trained.resumed_from_step if trained else 0,
        client_runs=trained.client_runs if trained and cfg.mode == "custom" else None,
        metrics=run_metrics(cfg, progress),
        checkpoints=checkpoints_block(saved),
        manifest=discovered.manifest if discovered else None,
        artifacts=discovered.artifacts if discovered else [],
        restore=restore.as_report() if restore else None,
        evaluation=progress.evaluation,
        export=progress.exported.result if progress.exported else None,
        retention=progress.pruned.as_report() if progress.pruned else None,
        promotion=progress.promoted,
        timings_s=dict(progress.timings),
        cluster={"ranks": progress.ranks},
        failures=[{**f.as_dict(), "message": scrub(f.message)} for f in progress.failures],
        finished_at=time.time(),
    )
    return RunReport.model_validate(scrubbed(report.model_dump()))


def scrubbed(value: Any) -> Any:
    """`value` with every string inside it scrubbed (`txflow.log.scrub`); keys, numbers and the shape stay."""
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, dict):
        return {k: scrubbed(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [scrubbed(v) for v in value]
    return value


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


def write(cfg: RunConfig, report: RunReport, metrics_text: str) -> str:
    """Write report.json, metrics.jsonl and the curve into the run root; returns the report URL.

    A report.json already there (a run continued with --resume-from) is kept as report-<time>.json.
    """
    options = cfg.plain_storage_options()
    fs, path = fsspec.core.url_to_fs(cfg.run_root, **options)
    fs.makedirs(path, exist_ok=True)
    if fs.exists(f"{path}/report.json"):
        fs.copy(f"{path}/report.json", f"{path}/report-{int(time.time())}.json")
    png = curve_png(report.metrics)
    if png is not None:
        fs.pipe_file(f"{path}/curve.png", png)
        report.plot = f"{cfg.run_root}/curve.png"
    fs.pipe_file(f"{path}/metrics.jsonl", metrics_text.encode())
    fs.pipe_file(f"{path}/report.json", report.to_json().encode())
    return f"{cfg.run_root}/report.json"


def markdown(report: RunReport) -> str:
    """The run report as the Prefect UI shows it."""
    restore = report.restore or {}
    metrics = report.metrics
    lines = [
        f"# txflow run `{report.run_id}`: {report.status}",
        "",
        f"- mode: **{report.mode}**, {report.num_processes} processes, base model `{report.base_model}`",
        f"- dataset: `{report.dataset or 'bundled'}`"
        + (f", evaluated on `{report.eval_dataset}`" if report.eval_dataset else ""),
        f"- steps: {len(metrics)}" + (f", learning rate {report.learning_rate:g}" if report.learning_rate else "")
        + (f", resumed from step {report.resumed_from_step}" if report.resumed_from_step else ""),
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
    if report.checkpoints:
        for ckpt in report.checkpoints["all"]:
            lines.append(f"- {ckpt['kind']} checkpoint: `{ckpt['tinker_path']}` at `{ckpt['url']}`")
    if report.manifest:
        lines.append(f"- manifest: `{report.manifest}` ({len(report.artifacts)} artifacts)")
    if report.plot:
        lines.append(f"- curve: `{report.plot}`")
    png = curve_png(metrics)
    if png is not None:  # inline: the Prefect UI shows a data URI, and cannot open a path in the run root
        lines += ["", f"![{CURVES[_curve_key(metrics)]}](data:image/png;base64,{base64.b64encode(png).decode()})"]
    lines += answers_markdown(restore)
    lines += evaluation_markdown(report.evaluation)
    lines += export_markdown(report.export)
    lines += lifecycle_markdown(report)
    if (report.client_runs or 0) > 1:
        lines.append(f"- the custom client ran {report.client_runs} times: a cluster fault re-ran it from the start")
    if report.failures:
        lines += ["", "## Failures recovered or not", ""]
        for f in report.failures:
            who = f"rank {f['rank']} ({f['role']})" if f["rank"] is not None else f["role"]
            when = time.strftime('%H:%M:%S', time.localtime(f['detected_at']))
            lines.append(f"- {who}, exit code {f['exit_code']}, detected at {when}"
                         + (f" during {f['step']}" if f.get("step") else "")
                         + (f"; the retry resumed at {f['resumed_at']}" if f.get("resumed_at") else "")
                         + (f" from step {f['resumed_from_step']}" if f["resumed_from_step"] is not None else ""))
    if report.error:
        lines += ["", "## Error", "", "```", report.error[-3000:], "```"]
    lines += ["", "## Timings (s)", ""] + [f"- {k}: {v:.1f}" for k, v in report.timings_s.items()]
    return "\n".join(lines)


def evaluation_markdown(evaluation: dict | None) -> list[str]:
    """The evaluate step's scores, the base model's and the trained adapter's side by side."""
    if not evaluation:
        return []
    lines = ["", f"## {evaluation['task']}, scored by {evaluation['harness']}", "", "| model | accuracy | samples |",
             "|---|---|---|"]
    return lines + [f"| `{s['model']}` | {s['accuracy']:.1%} | {s['samples']} |" for s in evaluation["scores"]]


def answers_markdown(restore: dict) -> list[str]:
    """Held-out prompts with the base model's and the trained model's answers, and their accuracy."""
    shown = restore.get("answers")
    if not shown:
        return []
    lines = ["", "## Answers before and after training", ""]
    if "accuracy" in restore:
        lines += [f"Held-out accuracy: **{restore['base_accuracy']:.0%}** base model, **{restore['accuracy']:.0%}** "
                  f"trained (greedy, exact answer).", ""]
    expected = all("expected" in a for a in shown)
    lines += ["| prompt |" + (" expected |" if expected else "") + " base model | trained |",
              "|---|" + ("---|" if expected else "") + "---|---|"]
    for a in shown:
        cells = [a["prompt"], *([a["expected"]] if expected else []), a["base"], a["trained"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return lines


def answers_text(report: RunReport) -> list[str]:
    """The same for a terminal: one line a prompt, then the accuracy."""
    restore = report.restore or {}
    lines = [f"  {a['prompt']!r}" + (f" (expected {a['expected']})" if "expected" in a else "")
             + f": base model {a['base']!r}, trained {a['trained']!r}" for a in restore.get("answers") or []]
    if "accuracy" in restore:
        lines.append(f"  held-out accuracy: {restore['base_accuracy']:.0%} base model -> {restore['accuracy']:.0%} "
                     f"trained")
    return lines


def lifecycle_markdown(report: RunReport) -> list[str]:
    """What prune-checkpoints deleted and what became of the promotion."""
    lines = []
    retention = report.retention
    if retention:
        lines += ["", "## Retention", "",
                  f"- kept the newest {retention['keep_last']} periodic states; {len(retention['deleted'])} deleted, "
                  f"{retention['bytes_freed']:,} bytes freed"]
        lines += [f"  - `{d['url']}` ({d['bytes']:,} bytes): {d['reason']}" for d in retention["deleted"]]
    promoted = report.promotion
    if promoted:
        lines += ["", "## Promotion", ""]
        if promoted.status == "promoted":
            lines += [f"- promoted as **{promoted.name}**: `{promoted.url}` (pointer `{promoted.pointer}`; "
                      f"`txflow promoted <checkpoints> {promoted.name}` shows it)"]
        else:
            lines += [f"- **not promoted** as {promoted.name}: {promoted.status}"]
        if promoted.approver:
            answer = "approved" if promoted.status == "promoted" else "answered"
            lines.append(f"- {answer} by: {promoted.approver}")
        if promoted.comment:
            lines.append(f"- approver's comment: {promoted.comment}")
    return lines


def approval_markdown(cfg: RunConfig, metrics: list[dict], restore: RestoreCheck, exported: ExportResult) -> str:
    """What the person approving sees in the Prefect UI: the figures the promotion would publish."""
    last = {k: v for k, v in (metrics[-1] if metrics else {}).items() if k != "step"}
    figures = {**last, **restore.quality, "restore |loss diff|": restore.abs_diff,
               "export max |Δ logprob|": exported.max_abs_logprob_diff}
    rows = [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in figures.items()
            if v is not None]
    return "\n".join([f"Promote run `{cfg.run_id}` ({cfg.mode}, {len(metrics)} steps, base model `{cfg.base_model}`) "
                      f"as **{cfg.export.promote_as}**? Every check passed.", "", "| figure | value |", "|---|---|",
                      *rows,
                      "", f"Adapter: `{exported.peft_url}`; report: `{cfg.run_root}/report.json`"])


def export_markdown(block: ExportResult | None) -> list[str]:
    """The export's figures in the markdown report, and how to load what it wrote."""
    if not block:
        return []
    verdict = "passed" if block.passed else "FAILED"
    lines = ["", "## Exported adapter", "",
             f"- proof: **{verdict}**: transformers + peft reproduce SkyRL's restored sampler with max |Δ logprob| "
             f"{block.max_abs_logprob_diff:.2e} (bound {block.logprob_bound:.3g}{noise_note(block)}), greedy "
             f"tokens match: {block.greedy_tokens_match}",
             f"- source: `{block.sampler_url}`; LoRA r {block.r}, alpha {block.lora_alpha:g} on "
             f"{', '.join(block.target_modules)}"]
    if block.problem:
        lines.append(f"- problem: {block.problem}")
    if block.peft_url:
        lines.append(f"- PEFT adapter: `{block.peft_url}`")
    if block.merged_url:
        lines.append(f"- merged model: `{block.merged_url}` (max |Δ logprob| "
                     f"{block.merged_max_abs_logprob_diff:.2e} against the PEFT model, greedy tokens match: "
                     f"{block.merged_greedy_tokens_match})")
    lines += [f"- note: {note}" for note in block.notes or []]
    if block.peft_url:
        lines += ["", "Load the adapter (the directory copied locally):", "",
                  load_instructions(block.base_model, merged=False)]
    return lines


def publish_metrics(run_id: str, metrics: list[dict]) -> None:
    """The per-step metrics table on the Prefect flow run as it stands while the run trains (when there is one):
    each call a new version of the same artifact, whose latest the UI shows. A server that cannot take it is a
    warning: the table is a view of the run, not a step of it."""
    from prefect.artifacts import create_table_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None or not metrics:
        return
    try:
        create_table_artifact(metrics, key=f"metrics-{_artifact_key(run_id)}", description="Per-step training metrics")
    except Exception as exc:
        get_logger().warning(f"the metrics table of run {run_id} was not updated ({type(exc).__name__}: {exc})")


def _artifact_key(run_id: str) -> str:
    return run_id.lower().replace("_", "-")


def publish_artifacts(report: RunReport) -> None:
    """Markdown summary and per-step metrics table on the Prefect flow run (when there is one)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is None:
        return
    key = _artifact_key(report.run_id)
    create_markdown_artifact(markdown(report), key=f"report-{key}", description="txflow run report")
    if report.metrics:
        create_table_artifact(report.metrics, key=f"metrics-{key}", description="Per-step training metrics")
