"""`txflow cluster up|down|status|key`: a long-lived cluster that runs attach to (`--cluster NAME`)."""

from __future__ import annotations

import json
import os
import re
import sys
import time

from pydantic import ValidationError

from txflow.cli.options import config_values, fields_line
from txflow.config import RunConfig
from txflow.log import scrub
from txflow.processes import umask


def duration_s(text: str) -> float:
    """`30m`, `8h`, `2d`, `90s` or plain seconds, in seconds; ValueError in one line otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match:
        raise ValueError(f"--ttl {text!r}: give a duration such as 30m, 8h, 2d or a number of seconds")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match[2]]


def cluster_keys_cmd(args) -> int:
    """`txflow cluster key NAME` gives out a key; `txflow cluster keys NAME [--revoke LABEL]` lists or revokes."""
    from datetime import datetime

    from txflow.cluster import named

    if args.action == "key":
        ttl_s = duration_s(args.ttl)
        key, serves = named.issue_key(args.name, args.label, ttl_s)
        expires = datetime.fromtimestamp(time.time() + ttl_s).isoformat(timespec="minutes")
        print(f"export TINKER_BASE_URL={serves.base_url}\nexport TINKER_API_KEY={key}")
        print(f"txflow: key {args.label!r} on cluster {args.name} until {expires}: it reaches only what it creates; "
              f"base_model {serves.base_model}; revoke it with `txflow cluster keys {args.name} --revoke "
              f"{args.label}`", file=sys.stderr)
        return 0
    if args.revoke:
        if not named.revoke_key(args.name, args.revoke):
            print(f"txflow: cluster {args.name} has no key labelled {args.revoke}", file=sys.stderr)
            return 2
        print(f"txflow: key {args.revoke!r} revoked on cluster {args.name}", file=sys.stderr)
        return 0
    rows = named.list_keys(args.name)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        when = (f"expires {datetime.fromtimestamp(row['expires']).isoformat(timespec='minutes')}"
                + (" (expired)" if row["expired"] else "") if row["expires"] else "until the run releases it")
        print(f"{row['kind']:4} {row['label']:24} {when}")
    return 0


def cluster_cmd(args) -> int:
    """`txflow cluster up|status|down|key|keys NAME`: 0 when done (status: when healthy), 1 when not, 2 on bad
    input."""
    from txflow.cluster import named

    os.umask(umask.PRIVATE)
    try:
        if args.action in ("key", "keys"):
            return cluster_keys_cmd(args)
        if args.action == "status":
            found = named.status(args.name)
            if args.json:
                print(json.dumps(found, indent=2))
            else:
                print(f"cluster {args.name}: {'healthy' if found['healthy'] else 'NOT healthy'} ({found['state']}), "
                      f"{found['base_model']} on {found['base_url']}, LoRA rank <= {found['max_lora_rank']}, "
                      f"{found['free_slots']} of {found['lora_adapters'] - 1} adapter slots free, attached: "
                      f"{', '.join(found['attached_runs']) or 'none'}")
            return 0 if found["healthy"] else 1
        if args.action == "down":
            records = named.down(args.name)
            print(f"txflow: cluster {args.name} down: "
                  + (", ".join(f"{r.role} pid {r.pid} exit {r.exit_text}" for r in records) or "nothing ran"),
                  file=sys.stderr)
            return 0
        values = {k: v for k, v in config_values(args).items() if k not in ("name", "action")}
        config = RunConfig.model_validate(values)
    except (named.AttachFailed, ValueError) as exc:
        if isinstance(exc, ValidationError):
            exc = fields_line(exc)
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    from txflow.config import RUN_ID_PATTERN

    if not re.fullmatch(RUN_ID_PATTERN, args.name):
        print(f"txflow: cluster name {args.name!r} must be 1-64 letters, digits, '-' or '_'", file=sys.stderr)
        return 2
    if getattr(args, "detach", False):
        return _detached_up(args, config)
    from txflow.cluster.launcher import PlacementFailed

    try:
        handle = named.up(config, args.name)
    except (named.AttachFailed, PlacementFailed) as exc:
        print(f"txflow: {scrub(str(exc))}", file=sys.stderr)
        return 2
    print(f"txflow: cluster {args.name} up on {handle.cluster.base_url}; attach runs with --cluster {args.name}",
          file=sys.stderr, flush=True)
    records = named.hold(handle, args.name, config)
    print(f"txflow: cluster {args.name} stopped: " + ", ".join(f"{r.role} pid {r.pid} exit {r.exit_text}"
                                                              for r in records), file=sys.stderr)
    return 0 if not handle.monitor.failures else 1


def _detached_up(args, config: RunConfig) -> int:
    """`cluster up --detach`: the same `cluster up` without it, in a session of its own (no terminal's Ctrl-C or
    hang-up reaches it), waited for until the cluster is up: 0 then; its exit code and the end of its log if it
    ends first."""
    import subprocess

    from txflow.cluster import named

    log_path = named.clusters_dir() / f"{args.name}-holder.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [a for a in args.argv if a != "--detach"]
    with open(log_path, "w") as log:
        holder = subprocess.Popen([sys.executable, "-c", "from txflow.cli import entry; entry()", *argv],
                                  stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + config.startup_timeout_s + 60
    while time.monotonic() < deadline:
        code = holder.poll()
        serves = named.load_serves(args.name)
        if code is None and serves is not None and serves.holder_pid == holder.pid and serves.state == "up":
            print(f"txflow: cluster {args.name} up on {serves.base_url} (held by pid {holder.pid}, log {log_path}); "
                  f"attach runs with --cluster {args.name}, stop it with `txflow cluster down {args.name}`",
                  file=sys.stderr)
            return 0
        if code is not None:
            print(scrub(log_path.read_text()[-2000:]), end="", file=sys.stderr)
            return code or 1
        time.sleep(0.2)
    holder.terminate()  # its own shutdown stops whatever it started
    print(f"txflow: cluster {args.name} not up within {config.startup_timeout_s + 60:.0f} s; stopped it (log "
          f"{log_path})", file=sys.stderr)
    return 1
