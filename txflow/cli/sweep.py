"""`txflow sweep`: a grid of learning rates and LoRA ranks trained side by side on one cluster."""

from __future__ import annotations

import json
import os
import re
import signal
import sys

from pydantic import ValidationError

from txflow.cli.options import config_values, fields_line
from txflow.cli.run import on_sigterm
from txflow.config import (
    PROMOTION_NAME_PATTERN,
    RunConfig,
)
from txflow.log import scrub
from txflow.processes import umask


def sweep_cmd(args) -> int:
    """`txflow sweep sft|rl --learning-rate A,B --lora-rank K,L ...`: 0 when every member passed, 1 when one
    failed, 2 on bad input (any member's, before anything starts)."""
    os.umask(umask.PRIVATE)
    extra = {k: getattr(args, k) for k in ("sweep_id", "promote_best_as") if hasattr(args, k)}
    for k in extra:
        delattr(args, k)
    grid = {}
    try:
        for name, kind in (("learning_rate", float), ("lora_rank", int)):
            if hasattr(args, name):
                text = getattr(args, name)
                delattr(args, name)
                try:
                    grid[name] = [kind(v) for v in text.split(",") if v.strip()]
                except ValueError:
                    raise ValueError(f"--{name.replace('_', '-')} {text!r}: comma-separated numbers") from None
        if "promote_best_as" in extra and not re.fullmatch(PROMOTION_NAME_PATTERN, extra["promote_best_as"]):
            raise ValueError(f"--promote-best-as {extra['promote_best_as']!r} is no promotion name")
        if "sweep_id" in extra and not re.fullmatch(r"[A-Za-z0-9_-]{1,60}", extra["sweep_id"]):
            raise ValueError(f"--sweep-id {extra['sweep_id']!r} must be 1-60 letters, digits, '-' or '_'")
        refused = {"run_id": "a sweep names its runs <sweep-id>-NN: use --sweep-id",
                   "promote_as": "a sweep promotes its best run: use --promote-best-as",
                   "approve": "a sweep's runs do not wait for approval"}
        for field, why in refused.items():
            if hasattr(args, field):
                raise ValueError(f"--{field.replace('_', '-')}: {why}")
        config = RunConfig.model_validate(config_values(args))
    except ValueError as exc:
        if isinstance(exc, ValidationError):
            exc = fields_line(exc)
        print(f"txflow: invalid options: {scrub(str(exc))}", file=sys.stderr)
        return 2
    from flows.sweep import members_of, new_sweep_id, state_of
    from txflow.log import register_run_secrets

    register_run_secrets(config)
    sweep_id = extra.get("sweep_id") or new_sweep_id(config.mode)
    config = config.model_copy(update={"state_dir": str(state_of(config, sweep_id))})
    try:
        members_of(config, grid.get("learning_rate", []), grid.get("lora_rank", []), sweep_id)
    except ValueError as exc:  # PreflightError included: one member's bad input refuses the sweep
        if isinstance(exc, ValidationError):
            exc = "invalid options: " + fields_line(exc)
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, on_sigterm)
    from txflow.cluster import embedded_prefect

    print(f"txflow: sweep {sweep_id}, state directory {config.state_dir}", file=sys.stderr)
    with embedded_prefect.server(config.state_dir) as prefect_server:
        from flows.sweep import SweepFailed, sweep_flow

        if prefect_server is not None:
            prefect_server.wait_ready()
        try:
            result = sweep_flow(config=config, learning_rates=grid.get("learning_rate"),
                                lora_ranks=grid.get("lora_rank"), sweep_id=sweep_id,
                                promote_best_as=extra.get("promote_best_as"))
        except SweepFailed as failed:
            result = failed.result
    if args.json:
        print(json.dumps(result, indent=2))
    for row in result["members"]:
        figure = f", {result['ranked_by']} {row['figure']:.4g}" if row["figure"] is not None else ""
        why = f" ({row['error'].splitlines()[0]})" if row["error"] else ""
        print(f"txflow: #{row['rank'] or '-'} {row['run_id']} lr {row['learning_rate']:g} rank {row['lora_rank']}: "
              f"{row['status']}{why}{figure}", file=sys.stderr)
    promoted = result.get("promoted")
    print(f"txflow: sweep {sweep_id}: best {result['best'] or 'none (no member passed)'}"
          + (f", promoted as {promoted['name']}" if promoted else "") + f"; ranking at {result['ranking_file']}",
          file=sys.stderr)
    return 0 if not result["failed"] else 1
