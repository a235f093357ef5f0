"""`python -m txflow.upstream.skyrl_tx {api|engine|worker} ...`: the entry point of every process of the
cluster, upstream's with txflow's patches."""

import sys

from txflow.processes import lifeline

lifeline.watch_parent()  # first: this process dies with the one that started it

from txflow.upstream.skyrl_tx import check_upstream_version  # noqa: E402

command, rest = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
try:
    check_upstream_version()
except ValueError as exc:
    sys.exit(f"txflow: {exc}")
if command == "api":
    from txflow.upstream.skyrl_tx import api

    api.serve_api(rest)
elif command == "engine":
    from txflow.upstream.skyrl_tx import engine

    engine.run(rest)
elif command == "worker" and rest[:1] == ["--gate-timeout"]:
    from txflow.upstream.skyrl_tx import worker

    worker.run(rest[2:], gate_timeout_s=float(rest[1]))
else:
    sys.exit("usage: python -m txflow.upstream.skyrl_tx {api --host H --port P|engine|worker --gate-timeout S} "
             "<upstream args>")
