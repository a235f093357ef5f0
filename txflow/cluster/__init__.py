"""The run's cluster: `records` (cluster.json, written as soon as a process exists), `launcher` (the
interface) and `launchers/` (local subprocesses, Ray actors), `monitor` (the one health detector),
`handle` (one object for a running cluster: record, launcher, monitor, clients), `startup` (the start-up
sequence: provision, launch-workers, the environment of every process, the readiness proof), and
`embedded_prefect` (the Prefect server of `txflow run`, which dies with it).
"""
