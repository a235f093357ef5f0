"""Everything specific to SkyRL-tx 0.3.0 (import name `tx`) lives in this package.

Its modules follow the upstream process each patch changes: `api` (the Tinker API server: `external-engine`,
`quiet-command-lines`, `sdk-shims`, `result-wait`, `lora-flags`, `api-key-check`, `rest-surface` and its ends of
`wake-channel`, `tinker-losses` and `load-optimizer-flag`, with `tinker_compat` for `sdk-shims` and `protobuf` for its
wire format, `result_wait` for `result-wait` and `lora_config` for `lora-flags`), `engine` (rank 0:
`self-gated-startup`, `broadcast-delete-model`, `tinker-sampler-paths`, `prompt-logprobs` and its ends of `wake-channel`
and `load-optimizer-flag`), `worker` (ranks > 0: `self-gated-startup`), `ranks` (what every rank gets:
`rank0-checkpoint-io`, `tinker-losses`, `load-optimizer-flag`, `tied-head-from-arguments` and `scanned-layers`
installed, `default-sigterm`, `compilation-cache`, `loss-chunks`, `lora-per-example`, `sampling-buckets`,
`sampling-rows`), `models` (`tied-head-from-arguments`, `scanned-layers`, `tied-head-lora`, `prefill-once-per-prompt`,
`no-forward-after-the-last-token`;
the export's reference too), `checkpoint_io` (`rank0-checkpoint-io`, `load-optimizer-flag`), `losses` (`tinker-losses`,
both ends), `rest` (`rest-surface`; with `auth`'s signed downloads), `served` (`served-names`), `layout`
(`staged-checkpoints`, `tinker-sampler-paths`) and `launch` (`device-mesh`, `coordinator-bind` and the command line of
each process); `python -m txflow.upstream.skyrl_tx {api|engine|worker}` runs them. This module holds the names and
numbers of the pinned version and its guard.

The upstream behaviours this adapter works around are listed in `patches.PATCHES`, one record per change: its slug (how
code, tests and docs name it), the module that makes it, what it changes, why, and which upstream change makes it
unnecessary. `docs/upstream-patches.md` is generated from that table.

Guarded: the adapter patches exactly the upstream version it was written
against (`UPSTREAM_VERSION`); another one is refused at pre-flight and by the
entry points, before anything is patched (`check_upstream_version`).

Module names differ in the unified `skyrl` 0.4.0 package (`skyrl.tinker.api`,
`skyrl.tinker.engine`, `skyrl.backends.jax`); they are only named here.
"""

from __future__ import annotations

UPSTREAM_PACKAGE = "skyrl-tx"
UPSTREAM_VERSION = "0.3.0"
ENGINE_MODULE = "tx.tinker.engine"
WORKER_MODULE = "tx.tinker.backends.jax"
DATABASE_URL_ENV = "TX_DATABASE_URL"

# The Tinker SDK's default LoRA rank; the cluster must accept at least it.
TINKER_DEFAULT_RANK = 32


def check_upstream_version() -> None:
    """Refuse an installed SkyRL-tx other than the one this adapter patches."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version(UPSTREAM_PACKAGE)
    except PackageNotFoundError:
        installed = None
    if installed != UPSTREAM_VERSION:
        found = f"{UPSTREAM_PACKAGE} {installed} is installed" if installed else f"{UPSTREAM_PACKAGE} is not installed"
        raise ValueError(f"{found}, but txflow's adapter (txflow/upstream/skyrl_tx/) works around the behaviour of "
                         f"{UPSTREAM_PACKAGE} {UPSTREAM_VERSION} and patches it: install "
                         f"{UPSTREAM_PACKAGE}=={UPSTREAM_VERSION} (see constraints.txt)")

