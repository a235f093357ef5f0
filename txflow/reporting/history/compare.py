"""The rule that judges tonight's figures against the nights before: each figure's better direction and
floors (`FIGURES`), a robust baseline and noise band over a trailing window (`compare`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal

from txflow.reporting.history.record import NightlyRecord

Direction = Literal["lower", "higher", "none"]
Verdict = Literal["ok", "improved", "regression", "first night", "not enough history", "missing", "untracked"]


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
    # numeric changes (sampling amplifies them), and across seeds the gain spans 0.13-0.48 on the tiny model (10
    # seeds) and 0.10-0.14 on the real model's nightly (4 seeds; docs/modes.md). The run's own check already proves
    # learning (gain >= 0.05, p <= 0.01); here a fall of more than 0.25 (learning collapsed to about half) is what
    # counts.
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
