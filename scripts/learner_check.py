"""Do the mode checks tell a working learner from a broken one? The nightly configuration, 10 seeds each way.

For each configuration below, runs the real `train` flow (its own cluster, its own
embedded Prefect server, in a subprocess) once per seed, with the learner working
or deliberately broken in that subprocess only:

- SFT, learning rate 0 (Adam gets lr 0 whatever the config says);
- RL, advantages with the wrong sign (rewards negated before the update), or all zero.

and records whether the run's quality check passed, with its figures. Prints a
markdown table (docs/modes.md's) and writes one JSON line per run to `--out`. The
check is right when it passes every working run and fails every broken one.
Not part of `make test`: on the tiny model at 2 processes it took about an hour and a half; a real-model run
takes 6-20 minutes here.

    python scripts/learner_check.py [--seeds 10] [--only sft,rl] [--base-model tiny] [--out learner_check.jsonl]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deployments.defaults import NIGHTLY_RL, NIGHTLY_SFT  # noqa: E402

# label, mode, config, how the learner is broken (None: working), seeds (None: --seeds, else --extra-seeds)
EXPERIMENTS = [
    ("SFT, nightly", "sft", NIGHTLY_SFT, None, None),
    ("SFT, learning rate 0", "sft", NIGHTLY_SFT, "lr0", None),
    ("RL, nightly", "rl", NIGHTLY_RL, None, None),
    ("RL PPO, advantages of the wrong sign", "rl", NIGHTLY_RL, "flip", None),
    ("RL PPO, zero advantages", "rl", NIGHTLY_RL, "zero", "extra"),
    ("RL importance sampling, 4 substeps", "rl", {**NIGHTLY_RL, "loss": "importance_sampling"}, None, "extra"),
    ("RL importance sampling, wrong sign", "rl", {**NIGHTLY_RL, "loss": "importance_sampling"}, "flip", "extra"),
]

# Runs in the subprocess: break the learner as asked, run the flow, print the report.
RUN = textwrap.dedent("""
    import json, sys
    import tinker
    from txflow.cluster import embedded_prefect
    from txflow.training import rl

    config, broken = json.loads(sys.argv[1]), sys.argv[2]
    if broken == "lr0":
        adam = tinker.types.AdamParams
        tinker.types.AdamParams = lambda **kw: adam(**{**kw, "learning_rate": 0.0})
    elif broken in ("flip", "zero"):
        to_datums = rl.to_datums

        def broken_datums(groups, data):
            factor = -1.0 if broken == "flip" else 0.0
            changed = [[rl.Rollout(r.row, r.tokens, r.logprobs, factor * r.reward) for r in g] for g in groups]
            return to_datums(changed, data)

        rl.to_datums = broken_datums
    from flows.train import RunFailed, train_flow
    from txflow.config import RunConfig

    cfg = RunConfig.model_validate(config).resolved()
    with embedded_prefect.server(cfg.state_dir) as server:
        server.wait_ready()
        try:
            report = train_flow(config=cfg)
        except RunFailed as failed:
            report = failed.report
    print("REPORT " + json.dumps({"status": report.status, "restore": report.restore, "error": report.error}))
""")

FIGURES = {"sft": ("eval_loss_gain", "held-out loss gain over the base model (nats)"),
           "rl": ("reward_gain", "eval reward gain over the base model")}


def run(config: dict, broken: str | None, work: Path, env: dict) -> dict:
    run_id = f"{config['mode']}-{broken or 'ok'}-s{config['seed']}-{int(time.time())}"
    config = {**config, "run_id": run_id, "state_dir": str(work / run_id), "checkpoints": str(work / "ckpt")}
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-c", RUN, json.dumps(config), broken or ""], env=env, cwd=work,
                            capture_output=True, text=True, timeout=1800)
    line = next((out for out in result.stdout.splitlines() if out.startswith("REPORT ")), None)
    if line is None:
        raise SystemExit(f"run {run_id} gave no report (exit {result.returncode}):\n{result.stderr[-3000:]}")
    report = json.loads(line.removeprefix("REPORT "))
    restore = report["restore"] or {}
    return {"run_id": run_id, "seed": config["seed"], "broken": broken, "status": report["status"],
            "check_passed": bool(restore.get("quality_passed")), "restore_passed": bool(restore.get("passed")),
            "figures": {k: v for k, v in restore.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
            "seconds": round(time.monotonic() - began, 1), "error": report["error"]}


def print_table(rows: list[tuple[str, str, str | None, list[dict]]]) -> None:
    """The table of docs/modes.md: one row per experiment (label, mode, how broken, results)."""
    print("| configuration | learner | seeds | " + " / ".join(f for f, _ in FIGURES.values())
          + " (min ... max) | RL sign-flip p (max) | median run (s) | check passed | right |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, mode, broken, results in rows:
        key = FIGURES[mode][0]
        values = [r["figures"].get(key) for r in results if r["figures"].get(key) is not None]
        span = f"{min(values):+.3f} ... {max(values):+.3f}" if values else "-"
        ps = [r["figures"]["sign_flip_p"] for r in results if "sign_flip_p" in r["figures"]]
        p_max = f"{max(ps):.2g}" if ps else "-"
        passed = sum(r["check_passed"] for r in results)
        right = passed == len(results) if broken is None else passed == 0
        seconds = statistics.median(r["seconds"] for r in results)
        print(f"| {label} | {'broken' if broken else 'working'} | {len(results)} | {span} | {p_max} | {seconds:.0f} | "
              f"{passed}/{len(results)} | {'yes' if right else '**NO**'} |")


def rows_from(path: str) -> list[tuple[str, str, str | None, list[dict]]]:
    """The experiments of a JSONL written by an earlier run, in EXPERIMENTS order."""
    results: dict[str, list[dict]] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        results.setdefault(row["experiment"], []).append(row)
    return [(label, mode, broken, results[label]) for label, mode, _, broken, _ in EXPERIMENTS if label in results]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0, help="continue an interrupted run from this seed")
    parser.add_argument("--extra-seeds", type=int, default=3, help="seeds of the side experiments (zero advantages, "
                        "importance sampling)")
    parser.add_argument("--only", default="sft,rl", help="modes to run")
    parser.add_argument("--experiment", help="run only the experiments whose label contains this text")
    parser.add_argument("--out", default="learner_check.jsonl")
    parser.add_argument("--base-model", help="the model of every run (default: the nightly's, the real model; "
                        "`tiny` for the toy)")
    parser.add_argument("--table-from", metavar="JSONL", help="only print the table of an earlier run's --out")
    args = parser.parse_args()
    if args.table_from:
        print_table(rows_from(args.table_from))
        return 0
    work = Path(tempfile.mkdtemp(prefix="learner-check-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its processes have stopped by then
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_URL")}
    env.update(PREFECT_HOME=str(work / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               DO_NOT_TRACK="1", TINKER_TELEMETRY="0")
    subprocess.run([str(Path(sys.executable).parent / "prefect"), "server", "database", "upgrade", "-y"], env=env,
                   check=True, capture_output=True, timeout=300)
    rows = []
    with open(args.out, "a") as out:
        for label, mode, config, broken, seeds in EXPERIMENTS:
            if mode not in args.only.split(",") or (args.experiment and args.experiment not in label):
                continue
            results = []
            for seed in range(args.first_seed, args.extra_seeds if seeds == "extra" else args.seeds):
                model = {"base_model": args.base_model} if args.base_model else {}
                result = run({**config, **model, "seed": seed}, broken, work, env)
                out.write(json.dumps({"experiment": label, **result}) + "\n")
                out.flush()
                results.append(result)
                print(f"{label}, seed {seed}: check {'passed' if result['check_passed'] else 'failed'} "
                      f"{FIGURES[mode][0]} {result['figures'].get(FIGURES[mode][0])}", file=sys.stderr, flush=True)
            rows.append((label, mode, broken, results))
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
