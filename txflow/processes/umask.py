"""The files a run creates are its own: directories 0700, files 0600.

A run's state directory holds the SkyRL-tx database (every request, so the training data), its logs,
cluster.json and staging checkpoints; a local checkpoint root holds the weights. With the usual umask
022 every local user could read them. The mask is inherited by every process the run starts, so the
database files the API creates, the checkpoints rank 0 writes and the logs are covered too. It only
narrows what is created: an existing directory keeps its mode.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

PRIVATE = 0o077


@contextmanager
def private_files():
    """Inside: everything this process and its children create has no group or other permission bits."""
    previous = os.umask(PRIVATE)
    try:
        yield
    finally:
        os.umask(previous)
