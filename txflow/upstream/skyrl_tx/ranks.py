"""What every rank process gets before upstream's entry point runs: txflow's checkpoint I/O (point 6),
the default SIGTERM action after `jax.distributed.initialize` (point 7) and Tinker's losses (point 13)."""

from __future__ import annotations

import sys

from txflow.upstream.skyrl_tx import losses
from txflow.upstream.skyrl_tx.checkpoint_io import install_checkpoint_io


def default_sigterm_after_distributed_init() -> None:
    """Make `jax.distributed.initialize` give SIGTERM its default action back (point 7)."""
    import signal

    import jax

    initialize = jax.distributed.initialize

    def initialize_then_default_sigterm(*args, **kwargs):
        initialize(*args, **kwargs)
        # A kernel-level action: it stops the rank also while its main thread waits in a collective.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    jax.distributed.initialize = initialize_then_default_sigterm




def run(module: str, argv: list[str], patch=None) -> None:
    """Import upstream's entry point `module`, install what every rank gets and then `patch(entry)`,
    and run it with `argv`."""
    import importlib

    entry = importlib.import_module(module)  # the slow part (~8 s), before any gate
    install_checkpoint_io()
    default_sigterm_after_distributed_init()
    losses.install_backend()
    if patch is not None:
        patch(entry)
    sys.argv = [module, *argv]
    entry.main()
