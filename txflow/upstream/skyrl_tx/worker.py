"""Ranks > 0, the JAX workers: the `self-gated-startup` change, each joins once rank 0's coordinator accepts
connections."""

from __future__ import annotations

import sys

from txflow.upstream.skyrl_tx import WORKER_MODULE, ranks


def gate_on_coordinator(address: str, timeout_s: float) -> None:
    """Block until rank 0's JAX coordinator accepts connections (`self-gated-startup`); exit with a message after
    `timeout_s`."""
    import socket
    import time

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            print(f"txflow: coordinator {address} accepts connections; joining", file=sys.stderr, flush=True)
            return
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"txflow: rank 0's JAX coordinator did not listen on {address} within {timeout_s:.0f} s")
            time.sleep(0.1)




def run(argv: list[str], gate_timeout_s: float) -> None:
    """A worker on upstream's command line `argv`, joining once the coordinator it names listens."""
    ranks.run(WORKER_MODULE, argv,
              lambda entry: gate_on_coordinator(argv[argv.index("--coordinator-address") + 1], gate_timeout_s))
