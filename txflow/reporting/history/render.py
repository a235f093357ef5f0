"""The nightly as people read it: the markdown summary, the figures table and the trend plot."""

from __future__ import annotations

import io
import math

from txflow.reporting.history.compare import (
    FIGURES,
    KEY_FIGURES,
    MIN_HISTORY,
    WINDOW,
    Comparison,
    regressions,
)
from txflow.reporting.history.record import NightlyRecord


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if abs(value) < 1e-3 or abs(value) >= 1e5:
        return f"{value:.2e}"
    return f"{value:.4g}"


def regression_message(comparisons: list[Comparison]) -> str:
    """One sentence per regression: the figure, tonight's value, the baseline and the limit."""
    return "; ".join(
        f"{c.figure} regressed: tonight {_fmt(c.tonight)}, baseline {_fmt(c.baseline)} (median of {c.history} "
        f"nights), {'at most' if c.direction == 'lower' else 'at least'} {_fmt(c.limit)} passes"
        for c in regressions(comparisons))


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
