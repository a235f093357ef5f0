"""A sweep's grid and the ranking of its members (the best is promoted by `txflow.artifacts.promote.best`).

Each member is a full `train` run (its own checkpoints, proofs and report); the ranking orders the members
that passed by their held-out figure, the quality check each run already computes: the held-out loss after
training for sft (lower is better), the held-out reward for rl (higher is better), with the run's gain and
its p-value beside it. A member that failed is listed with its error and ranked last."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from txflow.config import RunConfig
from txflow.reporting.report import RunReport

# The figure that ranks members, by mode, and whether lower is better.
RANK_BY = {"sft": ("final_eval_loss", True), "rl": ("eval_reward", False)}


def grid(config: RunConfig, sweep_id: str, learning_rates: list[float], lora_ranks: list[int],
         cluster: str, state: Path) -> list[RunConfig]:
    """One resolved run config per point of the grid, each attached to `cluster`, named `<sweep_id>-NN`, its
    state under the sweep's `state`. Bad input (too few points, a repeated one) raises ValueError."""
    for flag, values in (("--learning-rate", learning_rates), ("--lora-rank", lora_ranks)):
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise ValueError(f"{flag} lists {', '.join(f'{v:g}' for v in twice)} more than once")
    points = list(itertools.product(learning_rates or [config.learning_rate], lora_ranks or [config.lora_rank]))
    if len(points) < 2:
        raise ValueError("a sweep needs at least two points: --learning-rate and/or --lora-rank with several "
                         "comma-separated values")
    members = []
    for i, (rate, rank) in enumerate(points):
        run_id = f"{sweep_id}-{i:02d}"
        members.append(RunConfig.model_validate(
            {**config.model_dump(exclude={"run_id": True, "state_dir": True, "api_key": True, "database_url": True,
                                          "storage_options": True, "export": {"promote_as", "approve"}}),
             "storage_options": config.storage_options, "database_url": config.database_url,
             "run_id": run_id, "state_dir": str(state / run_id), "learning_rate": rate, "lora_rank": rank,
             "cluster": cluster}).resolved())
    return members


def figure(report: RunReport) -> float | None:
    key = RANK_BY.get(report.mode, (None,))[0]
    value = (report.restore or {}).get(key)
    return float(value) if isinstance(value, int | float) else None


def ranking(members: list[RunConfig], reports: dict[str, RunReport | None], errors: dict[str, str],
            spans: dict[str, tuple[float, float]] | None = None) -> dict:
    """The sweep's ranking: passed members by their figure, best first, then the failed ones. `spans`: when the
    sweep started each member and when it ended (unix times; a member waiting for free slots starts late)."""
    rows = []
    for member in members:
        report = reports.get(member.run_id)
        restore = (report.restore or {}) if report else {}
        started_at, finished_at = (spans or {}).get(member.run_id, (None, None))
        rows.append({"run_id": member.run_id, "learning_rate": member.learning_rate, "lora_rank": member.lora_rank,
                     "status": report.status if report else "failed",
                     "error": (report.error if report else None) or errors.get(member.run_id),
                     "figure": figure(report) if report else None,
                     "gain": next((v for k, v in restore.items() if k.endswith("_gain")), None),
                     "p_value": restore.get("sign_flip_p"),
                     "run_root": member.run_root, "started_at": started_at, "finished_at": finished_at})
    mode = members[0].mode if members else "sft"
    key, lower = RANK_BY.get(mode, ("figure", True))

    def rankable(row: dict) -> bool:
        return row["status"] == "passed" and row["figure"] is not None

    # Passed members by their figure, best first; the others after them, in the grid's order (a stable sort).
    ranked = sorted(rows, key=lambda r: (0, r["figure"] if lower else -r["figure"]) if rankable(r) else (1, 0))
    for place, row in enumerate(ranked, 1):
        row["rank"] = place if rankable(row) else None
    return {"mode": mode, "ranked_by": key, "lower_is_better": lower, "members": ranked,
            "best": next((r["run_id"] for r in ranked if r["rank"] == 1), None),
            "failed": [r["run_id"] for r in ranked if r["status"] != "passed"]}


def markdown(sweep_id: str, result: dict) -> str:
    lines = [f"# Sweep {sweep_id}", "", f"Ranked by {result['ranked_by']} "
             f"({'lower' if result['lower_is_better'] else 'higher'} is better)", "",
             "| rank | run | learning rate | LoRA rank | status | figure | gain | p |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["members"]:
        fig = "-" if r["figure"] is None else f"{r['figure']:.4g}"
        gain = "-" if r["gain"] is None else f"{r['gain']:.4g}"
        p = "-" if r["p_value"] is None else f"{r['p_value']:.3g}"
        lines.append(f"| {r['rank'] or '-'} | {r['run_id']} | {r['learning_rate']:g} | {r['lora_rank']} | "
                     f"{r['status']}{': ' + r['error'].splitlines()[0] if r['error'] else ''} | {fig} | {gain} | {p} |")
    return "\n".join(lines)


def artifact_key(sweep_id: str) -> str:
    """The ranking's Prefect artifact key: a key takes lowercase letters, digits and dashes only, and a sweep id
    may hold capitals and '_' (refused at the end of the sweep, after every member trained)."""
    return f"ranking-{sweep_id.lower().replace('_', '-')}"


def write(directory: Path, sweep_id: str, result: dict) -> Path:
    """ranking.json (what `txflow sweep --json` prints) and ranking.md (the table of the Prefect artifact)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ranking.md").write_text(markdown(sweep_id, result) + "\n")
    path = directory / "ranking.json"
    result["ranking_file"] = str(path)
    path.write_text(json.dumps(result, indent=2))
    return path
