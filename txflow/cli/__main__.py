"""`python -m txflow.cli`: the `txflow` command."""

from txflow.cli import entry

entry()
