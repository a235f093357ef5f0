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

Pure functions of their inputs plus the store: nothing here knows the flow.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import secrets
import statistics
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Literal

import fsspec
from pydantic import BaseModel, Field, ValidationError, field_validator

FORMAT = 1
RECORDS_DIR = "records"
FIGURE_KEY = re.compile(r"^[a-z0-9_]+(\.[a-z0-9_]+)+$")

Direction = Literal["lower", "higher", "none"]
Verdict = Literal["ok", "improved", "regression", "first night", "not enough history", "missing", "untracked"]


# --- the record --------------------------------------------------------------------------


class Versions(BaseModel, extra="forbid"):
    """What ran tonight: the upstream packages and the txflow checkout."""

    skyrl_tx: str = Field(description="Installed skyrl-tx version, or 'unknown'.")
    tinker: str = Field(description="Installed tinker SDK version, or 'unknown'.")
    jax: str = Field(description="Installed jax version, or 'unknown'.")
    txflow_commit: str = Field(default="unknown", description="git commit of the txflow checkout, or 'unknown'.")


class NightlyRecord(BaseModel, extra="forbid"):
    """One nightly run: when, what ran, its figures, and how it ended."""

    id: str = Field(default_factory=lambda: secrets.token_hex(8), pattern=r"^[a-z0-9]{4,32}$",
                    description="Unique id; part of the object name.")
    started_at: datetime = Field(description="When the nightly run started (timezone-aware, stored as UTC).")
    finished_at: datetime | None = Field(default=None, description="When it finished.")
    versions: Versions
    run_ids: dict[str, str] = Field(default_factory=dict, description="Run id of each mode's run, e.g. {'sft': ...}.")
    figures: dict[str, float] = Field(
        default_factory=dict,
        description="Flat figures keyed `<mode>.<figure>`; directions and tolerances are declared in FIGURES.")
    status: Literal["passed", "regression", "failed"] = Field(
        default="passed",
        description="passed; regression (the runs passed, a figure regressed); failed (a run failed or missed "
                    "its own checks). Failed nights are kept but never form a baseline.")

    @field_validator("started_at", "finished_at")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("timestamps must be timezone-aware (use datetime.now(timezone.utc))")
        return value.astimezone(timezone.utc)

    @field_validator("figures")
    @classmethod
    def _figures(cls, value: dict[str, float]) -> dict[str, float]:
        for key, number in value.items():
            if not FIGURE_KEY.match(key):
                raise ValueError(f"figure key {key!r} must look like 'mode.figure' (lowercase, digits, '_', '.')")
            if not math.isfinite(number):
                raise ValueError(f"figure {key} is {number}; leave a figure out instead of recording a non-number")
        return value


def current_versions(checkout: str | Path | None = None) -> Versions:
    """Versions of skyrl-tx, tinker and jax installed here, and the git commit of the txflow checkout."""

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "unknown"

    commit = "unknown"
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout or Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", out.stdout.strip()):
            commit = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return Versions(skyrl_tx=installed("skyrl-tx"), tinker=installed("tinker"), jax=installed("jax"),
                    txflow_commit=commit)


# --- the figures and their rule -------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """How one figure is judged: its better direction and the smallest worsening that can count."""

    direction: Direction
    label: str
    rel_tol: float = 0.0  # of the baseline's magnitude
    abs_tol: float = 0.0


def _seconds(label: str) -> Figure:
    # A shared machine jitters by tens of percent; a 40% slower step must still show.
    return Figure("lower", label, rel_tol=0.25, abs_tol=0.5)


FIGURES: dict[str, Figure] = {
    "sft.final_eval_loss": Figure("lower", "SFT held-out loss after training", abs_tol=0.02),
    "sft.eval_loss_gain": Figure("higher", "SFT held-out loss: base minus trained", abs_tol=0.02),
    "sft.restore_abs_diff": Figure("lower", "SFT restore |loss diff|", abs_tol=1e-6),
    "sft.startup_s": _seconds("SFT cluster start-up (s)"),
    "sft.median_step_s": _seconds("SFT median step (s)"),
    "sft.save_s": _seconds("SFT save (s)"),
    "sft.total_s": _seconds("SFT run total (s)"),
    # RL quality is judged on the gain only, with a wide floor: a fixed-seed RL run is chaotic under tiny
    # numeric changes (sampling amplifies them), and across seeds the nightly configuration's gain spans
    # 0.13-0.48 (10 seeds measured). The run's own check already proves learning (gain >= 0.05, p <= 0.01);
    # here a fall of more than 0.25 (learning collapsed to about half) is what counts.
    "rl.eval_reward": Figure("none", "RL eval reward of the saved sampler"),
    "rl.base_eval_reward": Figure("none", "RL eval reward of the base model"),
    "rl.reward_gain": Figure("higher", "RL eval reward: saved minus base", abs_tol=0.25),
    "rl.clip_fraction": Figure("none", "RL mean fraction of clipped tokens (ppo)"),
    "rl.restore_abs_diff": Figure("lower", "RL restore |loss diff|", abs_tol=1e-6),
    "rl.startup_s": _seconds("RL cluster start-up (s)"),
    "rl.median_step_s": _seconds("RL median step (s)"),
    "rl.save_s": _seconds("RL save (s)"),
    "rl.total_s": _seconds("RL run total (s)"),
    "nightly.total_s": _seconds("whole nightly (s)"),
}

# Drawn in the trend plot, in this order.
KEY_FIGURES = ("sft.final_eval_loss", "rl.reward_gain", "sft.median_step_s", "rl.median_step_s", "rl.startup_s",
               "nightly.total_s")

WINDOW = 7
MIN_HISTORY = 3
SPREAD_K = 4.0
MAD_TO_SIGMA = 1.4826  # MAD of a normal sample times this estimates its standard deviation


@dataclass(frozen=True)
class Comparison:
    """Tonight's value of one figure against the trailing history."""

    figure: str
    direction: Direction
    tonight: float | None
    baseline: float | None
    band: float | None  # how much worse than the baseline tonight may be
    history: int  # records the baseline was computed from
    verdict: Verdict

    @property
    def limit(self) -> float | None:
        """The worst value that still passes."""
        if self.baseline is None or self.band is None or self.direction == "none":
            return None
        return self.baseline + self.band if self.direction == "lower" else self.baseline - self.band


def compare(tonight: NightlyRecord, history: list[NightlyRecord], window: int = WINDOW,
            min_history: int = MIN_HISTORY, figures: dict[str, Figure] | None = None) -> list[Comparison]:
    """Judge each of tonight's figures against the same figure over the trailing history.

    The rule, per figure:
      - the history is the last `window` records before tonight that carry the figure and did not fail
        (a failed night's figures may be garbage; a night marked `regression` still counts, so a change
        that everybody accepts becomes the new normal after about half a window);
      - no record at all: "first night" (passes, and says so); fewer than `min_history`: "not enough
        history" (passes);
      - baseline = median of those values; noise = 1.4826 * their median absolute deviation (a robust
        standard deviation: one wild night neither moves the baseline nor widens the band much);
      - band = max(4 * noise, rel_tol * |baseline|, abs_tol), with the floors of the figure in FIGURES
        (timings 25% and 0.5 s; SFT losses 0.02 nats; RL reward gain 0.25; restore |diff| 1e-6);
      - "regression" when tonight is worse than the baseline by more than the band, in the figure's
        direction; "improved" when it is better by more than the band; otherwise "ok".
    Where the noise term sets the band, chance alone flags a steady figure on about 2.5% of nights
    (simulated: Gaussian noise, window 7; window 10 gives 1.1%); the floors make that rarer for steady
    figures, and a worsening of 6 noise widths is caught 9 times in 10.
    Figures declared with direction "none" are shown but never judged ("untracked", as are keys not
    in FIGURES); a declared figure missing tonight is "missing" (the run that makes it failed, which
    fails the nightly by itself).
    """
    figures = FIGURES if figures is None else figures
    earlier = sorted((r for r in history if r.id != tonight.id and r.started_at <= tonight.started_at),
                     key=lambda r: r.started_at)
    usable = [r for r in earlier if r.status != "failed"]
    keys = list(dict.fromkeys([*(k for k in figures if k in tonight.figures or _seen(k, usable)),
                               *sorted(tonight.figures)]))
    out = []
    for key in keys:
        rule = figures.get(key)
        value = tonight.figures.get(key)
        values = [r.figures[key] for r in usable if key in r.figures][-window:]
        direction: Direction = rule.direction if rule else "none"
        baseline = statistics.median(values) if values else None
        if value is None:
            out.append(Comparison(key, direction, None, baseline, None, len(values), "missing"))
            continue
        if rule is None or rule.direction == "none":
            out.append(Comparison(key, direction, value, baseline, None, len(values), "untracked"))
            continue
        if not earlier:
            out.append(Comparison(key, direction, value, None, None, 0, "first night"))
            continue
        if len(values) < min_history:
            out.append(Comparison(key, direction, value, baseline, None, len(values), "not enough history"))
            continue
        noise = MAD_TO_SIGMA * statistics.median(abs(v - baseline) for v in values)
        band = max(SPREAD_K * noise, rule.rel_tol * abs(baseline), rule.abs_tol)
        worse = value - baseline if direction == "lower" else baseline - value
        verdict: Verdict = "regression" if worse > band else "improved" if -worse > band else "ok"
        out.append(Comparison(key, direction, value, baseline, band, len(values), verdict))
    return out


def _seen(key: str, records: list[NightlyRecord]) -> bool:
    return any(key in r.figures for r in records)


def regressions(comparisons: list[Comparison]) -> list[Comparison]:
    return [c for c in comparisons if c.verdict == "regression"]


def regression_message(comparisons: list[Comparison]) -> str:
    """One sentence per regression: the figure, tonight's value, the baseline and the limit."""
    return "; ".join(
        f"{c.figure} regressed: tonight {_fmt(c.tonight)}, baseline {_fmt(c.baseline)} (median of {c.history} "
        f"nights), {'at most' if c.direction == 'lower' else 'at least'} {_fmt(c.limit)} passes"
        for c in regressions(comparisons))


# --- the store --------------------------------------------------------------------------------


class HistoryError(RuntimeError):
    """A record could not be written; the message says where and why."""


def _canonical(record: NightlyRecord) -> str:
    return json.dumps(record.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def encode(record: NightlyRecord) -> bytes:
    """The object's bytes: the record with a checksum over its canonical JSON."""
    body = _canonical(record)
    envelope = {"format": FORMAT, "sha256": hashlib.sha256(body.encode()).hexdigest(), "record": json.loads(body)}
    return json.dumps(envelope, sort_keys=True, indent=1).encode()


def decode(data: bytes) -> NightlyRecord:
    """The record in an object's bytes; ValueError saying why when it is partial, damaged or foreign."""
    try:
        envelope = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not complete JSON ({len(data)} bytes; partly written?): {exc}") from None
    if not isinstance(envelope, dict) or set(envelope) != {"format", "sha256", "record"}:
        raise ValueError("not a history record envelope (format, sha256, record)")
    if envelope["format"] != FORMAT:
        raise ValueError(f"record format {envelope['format']!r}, this txflow reads format {FORMAT}")
    if not isinstance(envelope["record"], dict):
        raise ValueError("the record is not an object")
    body = json.dumps(envelope["record"], sort_keys=True, separators=(",", ":"))
    if hashlib.sha256(body.encode()).hexdigest() != envelope["sha256"]:
        raise ValueError("checksum mismatch: the record was changed or damaged after it was written")
    try:
        return NightlyRecord.model_validate(envelope["record"])
    except ValidationError as exc:
        raise ValueError(f"invalid record: {exc.error_count()} errors, first: {exc.errors()[0]['msg']}") from None


def object_name(record: NightlyRecord) -> str:
    """`records/<UTC start, sortable>-<id>.json`: names sort by time, and the id keeps them unique."""
    return f"{RECORDS_DIR}/{record.started_at:%Y%m%dT%H%M%S%fZ}-{record.id}.json"


def append(root: str, record: NightlyRecord, storage_options: dict | None = None) -> str:
    """Write `record` as a new object under `root` and read it back; returns its URL.

    Never overwrites: an existing object of the same name (the same id) is an error.
    """
    fs, base = fsspec.core.url_to_fs(root, **(storage_options or {}))
    path = f"{base.rstrip('/')}/{object_name(record)}"
    url = f"{root.rstrip('/')}/{object_name(record)}"
    data = encode(record)
    try:
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        if fs.exists(path):
            raise HistoryError(f"history record {url} exists already; a record id must be new")
        fs.pipe_file(path, data)
        if fs.cat_file(path) != data:
            raise HistoryError(f"history record {url} does not read back as written")
    except HistoryError:
        raise
    except Exception as exc:  # any backend error: the record is not safely stored
        raise HistoryError(f"cannot write history record {url}: {type(exc).__name__}: {exc}") from exc
    return url


def read(root: str, storage_options: dict | None = None) -> tuple[list[NightlyRecord], list[str]]:
    """Every readable record under `root`, oldest first, and one problem line per object skipped.

    A missing root is an empty history. An object that is partial, damaged, of another format or
    unreadable is named in `problems` with the reason, and skipped: it never fails the caller.
    """
    fs, base = fsspec.core.url_to_fs(root, **(storage_options or {}))
    directory = f"{base.rstrip('/')}/{RECORDS_DIR}"
    problems: list[str] = []
    try:
        paths = sorted(p for p in fs.find(directory) if p.endswith(".json"))
    except FileNotFoundError:
        return [], []
    records = []
    for path in paths:
        url = f"{root.rstrip('/')}/{RECORDS_DIR}/{path.rsplit('/', 1)[-1]}"
        try:
            records.append(decode(fs.cat_file(path)))
        except ValueError as exc:
            problems.append(f"{url}: skipped, {exc}")
        except Exception as exc:  # a read error of one object must not hide the others
            problems.append(f"{url}: skipped, cannot read it ({type(exc).__name__}: {exc})")
    records.sort(key=lambda r: (r.started_at, r.id))
    return records, problems


# --- artifacts --------------------------------------------------------------------------------


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if abs(value) < 1e-3 or abs(value) >= 1e5:
        return f"{value:.2e}"
    return f"{value:.4g}"


def table_rows(comparisons: list[Comparison]) -> list[dict[str, str]]:
    """Rows for a Prefect table artifact: figure, tonight, baseline, band, history, verdict."""
    return [{"figure": c.figure,
             "better": {"lower": "lower", "higher": "higher", "none": "-"}[c.direction],
             "tonight": _fmt(c.tonight),
             "baseline": _fmt(c.baseline),
             "band": f"±{_fmt(c.band)}" if c.band is not None else "-",
             "nights": str(c.history),
             "verdict": c.verdict.upper() if c.verdict == "regression" else c.verdict}
            for c in comparisons]


def markdown_summary(tonight: NightlyRecord, comparisons: list[Comparison], problems: list[str] = (),
                     window: int = WINDOW) -> str:
    """The nightly's summary: a headline, every regression with tonight's value and the baseline,
    the history problems, and the versions."""
    found = regressions(comparisons)
    first = any(c.verdict == "first night" for c in comparisons)
    if found:
        headline = f"**{len(found)} regression{'s' if len(found) > 1 else ''}** against the last {window} nights"
    elif first:
        headline = "first night: no history yet, nothing to compare against (passes)"
    else:
        headline = f"no regression against the last {window} nights"
    lines = [f"# Nightly validation {tonight.started_at:%Y-%m-%d %H:%M} UTC: {headline}", ""]
    for c in found:
        label = FIGURES[c.figure].label if c.figure in FIGURES else c.figure
        lines.append(f"- **{c.figure}** ({label}): tonight {_fmt(c.tonight)}, baseline {_fmt(c.baseline)} "
                     f"(median of {c.history} nights, noise band ±{_fmt(c.band)}); "
                     f"{c.direction} is better, {'at most' if c.direction == 'lower' else 'at least'} "
                     f"{_fmt(c.limit)} passes")
    waiting = [c.figure for c in comparisons if c.verdict == "not enough history"]
    if waiting:
        lines.append(f"- not enough history yet (fewer than {MIN_HISTORY} nights) for: {', '.join(waiting)}")
    missing = [c.figure for c in comparisons if c.verdict == "missing"]
    if missing:
        lines.append(f"- missing tonight (its run failed): {', '.join(missing)}")
    improved = [f"{c.figure} {_fmt(c.baseline)} -> {_fmt(c.tonight)}" for c in comparisons if c.verdict == "improved"]
    if improved:
        lines.append(f"- improved beyond noise: {'; '.join(improved)}")
    if problems:
        lines += ["", f"## History records skipped ({len(problems)})", ""] + [f"- {p}" for p in problems]
    v = tonight.versions
    lines += ["", f"Versions: skyrl-tx {v.skyrl_tx}, tinker {v.tinker}, jax {v.jax}, txflow {v.txflow_commit[:12]}"]
    if tonight.run_ids:
        lines.append("Runs: " + ", ".join(f"{mode} `{run_id}`" for mode, run_id in tonight.run_ids.items()))
    return "\n".join(lines)


def trend_png(records: list[NightlyRecord], keys: tuple[str, ...] = KEY_FIGURES) -> bytes | None:
    """Key figures over the nights (the last record marked), one panel each, as a PNG; None without data."""
    keys = tuple(k for k in keys if any(k in r.figures for r in records))
    if not keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure as MplFigure

    cols = 2 if len(keys) > 1 else 1
    rows = math.ceil(len(keys) / cols)
    fig = MplFigure(figsize=(5.5 * cols, 2.6 * rows), dpi=100)
    for i, key in enumerate(keys):
        ax = fig.add_subplot(rows, cols, i + 1)
        points = [(r.started_at, r.figures[key], r.status) for r in records if key in r.figures]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
        bad = [p for p in points if p[2] != "passed"]
        if bad:
            ax.scatter([p[0] for p in bad], [p[1] for p in bad], color="red", zorder=3, label="not passed")
        if records and key in records[-1].figures:
            ax.scatter([records[-1].started_at], [records[-1].figures[key]], s=60, facecolors="none",
                       edgecolors="black", zorder=4, label="tonight")
        ax.set_title(key, fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


# --- figures from a run -----------------------------------------------------------------------


def step_median(metrics: list[dict]) -> float | None:
    """Median seconds per step without the first step (it pays the JIT compile)."""
    seconds = [m["seconds"] for m in metrics[1:] if isinstance(m.get("seconds"), (int, float))]
    return statistics.median(seconds) if seconds else None


def figures_of(mode: str, values: dict[str, float | None]) -> dict[str, float]:
    """`{"<mode>.<name>": value}` for every finite value, e.g. figures_of("rl", {"median_step_s": 4.1})."""
    return {f"{mode}.{name}": float(v) for name, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def now() -> datetime:
    return datetime.now(timezone.utc)
