"""txflow: LoRA fine-tuning through the Tinker API on a self-hosted SkyRL-tx cluster, as one Prefect flow.

The run's contract sits here: `config` (the one run config), `log` (logging with redaction),
`results` (what the pipeline steps hand each other), `preflight` (bad input fails before anything
starts) and `cli` (the `txflow` command). The machinery the steps share lives in six rooms, each
importing only rooms below it:

    processes/    the ground floor: process groups, /proc, ports, logs, the lifeline
    upstream/     SkyRL-tx 0.3.0 and the Tinker SDKs: every patch, named in one table; the wake channel; the tiny model
    checkpoints/  commit markers, durable storage, discovery
    cluster/      the cluster's record, launchers (local, Ray), its handle and monitor, the embedded Prefect
    training/     sft, rl, custom clients, rewards, datasets, evaluation
    reporting/    the report, progress, the metrics file, the nightly history

`flows/` composes the pipeline steps of `tasks/` on top of them.
"""
