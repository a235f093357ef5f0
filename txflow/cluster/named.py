"""A long-lived cluster with a name, and the runs that attach to it.

`up` starts a cluster as a run's would start (`txflow.cluster.startup`), in `<clusters dir>/<name>/`, and the
process that started it holds it (its processes die with it, `txflow.processes.lifeline`) until `down`
signals that holder. `serves.json` beside `cluster.json` says what it serves and where: base model, LoRA
rank, adapter slots, its API and its holder. The API also lets in the keys in `run-keys.json`, each scoped
to the run that attached with it (the `api-key-check` change).

A run with `cluster` set attaches instead of provisioning: it registers a key of its own, checks that the
cluster is up, serves its base model and rank, and has a free adapter slot (waiting for one up to
`startup_timeout_s`), and watches the cluster's processes as its own. Its teardown (`release`) unloads its
models, removes its staging and revokes its key; the cluster stays up. A run killed before its teardown could run
(SIGKILL, out of memory) is released by the holder instead (`reap`), within seconds of its death.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import signal
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from pydantic import BaseModel, SecretStr

from txflow.cluster.handle import ClusterHandle
from txflow.cluster.launcher import LostProcess
from txflow.cluster.records import Cluster, ProcessRecord
from txflow.config import RUN_ID_PATTERN, RunConfig, checked_cluster_name
from txflow.log import get_logger, register_secret
from txflow.processes import procfs
from txflow.upstream.skyrl_tx.auth import OWNED_PATH, key_digest

CLUSTERS_DIR_ENV = "TXFLOW_CLUSTERS_DIR"
SERVES = "serves.json"
RUN_KEYS = "run-keys.json"
REAP_INTERVAL_S = 2.0  # how often the holder looks for attached runs that died without their teardown
# The RunConfig fields that shape a cluster (`txflow cluster up` takes these); the rest belong to runs.
CLUSTER_FIELDS = ("base_model", "processes", "devices_per_process", "launcher", "ray", "host", "mesh", "database_url",
                  "max_lora_rank", "lora_adapters", "startup_timeout_s", "concurrency_limit", "api_max_body_mb",
                  "api_max_samples", "api_max_tokens", "api_max_batch", "api_max_sessions_per_key",
                  "api_max_models_per_key")


class AttachFailed(RuntimeError):
    """A run cannot use the named cluster; the message says why in one line. Retrying does not help."""


class Serves(BaseModel):
    """What a named cluster serves, and where: `serves.json`."""

    name: str
    launcher: str
    base_model: str
    base_model_path: str
    max_lora_rank: int
    lora_adapters: int
    processes: int
    base_url: str
    sqlite: bool  # its database is the default SQLite file in its directory
    holder_pid: int
    holder_start_time: int | None
    state: str = "starting"  # starting, up, down
    ready_at: float | None = None
    # The death that made the holder stop the cluster (rank, role, exit_code, message): attached runs name it,
    # not the processes the holder's stop then ends (see `_Watch`).
    failure: dict | None = None


def clusters_dir() -> Path:
    return Path(os.environ.get(CLUSTERS_DIR_ENV) or Path(".txflow") / "clusters").absolute()


def cluster_dir(name: str) -> Path:
    """The named cluster's directory; ValueError for a name that is not one (`..`, `/abs`, empty), wherever
    it came from (the CLI, the cluster flow's parameter, a run's `cluster`)."""
    return clusters_dir() / checked_cluster_name(name)


def cluster_config(cfg: RunConfig, name: str) -> RunConfig:
    """The resolved config a named cluster starts from: its name as the run id, its directory as state."""
    return cfg.model_copy(update={"run_id": name, "state_dir": str(cluster_dir(name)), "cluster": None}).resolved()


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_serves(name: str) -> Serves | None:
    path = cluster_dir(name) / SERVES
    try:
        return Serves.model_validate_json(path.read_text())
    except FileNotFoundError:
        return None


def _save_serves(serves: Serves) -> None:
    _write_private(cluster_dir(serves.name) / SERVES, serves.model_dump_json(indent=2))


def holder_alive(serves: Serves) -> bool:
    return procfs.is_alive(serves.holder_pid, serves.holder_start_time)


# --- the cluster's side ---------------------------------------------------------------------------------


def up(cfg: RunConfig, name: str) -> ClusterHandle:
    """Start the named cluster and prove it ready; this process holds it (see `hold`)."""
    from txflow.cluster import startup
    from txflow.cluster.launchers import get_launcher
    from txflow.upstream.skyrl_tx import launch
    from txflow.upstream.tiny_model import resolve_base_model

    existing = load_serves(name)
    if existing is not None and existing.state != "down" and holder_alive(existing):
        raise AttachFailed(f"cluster {name} is up already (held by pid {existing.holder_pid}); "
                           f"`txflow cluster down {name}` stops it")
    ccfg = cluster_config(cfg, name)
    directory = cluster_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    keys = directory / RUN_KEYS
    _write_private(keys, "{}")  # a restarted cluster forgets the runs of the last one: they attach again
    if ccfg.database_url is None:
        # The last cluster's rows would say its models still hold slots: the engine starts from no model.
        for suffix in ("", "-wal", "-shm"):
            (directory / f"tinker.db{suffix}").unlink(missing_ok=True)
    serves = Serves(name=name, launcher=ccfg.launcher, base_model=ccfg.base_model,
                    base_model_path=resolve_base_model(ccfg.base_model),
                    max_lora_rank=launch.backend_config(ccfg, None)["max_lora_rank"], lora_adapters=ccfg.lora_adapters,
                    processes=ccfg.processes, base_url="", sqlite=ccfg.database_url is None, holder_pid=os.getpid(),
                    holder_start_time=procfs.start_time(os.getpid()))
    _save_serves(serves)
    handle = None
    try:  # provision stops what it started when it fails (on Ray: a cluster it cannot place)
        handle = startup.provision(ccfg, get_launcher(ccfg), serves.base_model_path,
                                   api_env=launch.run_keys_env(str(keys)))
        startup.launch_workers(ccfg, handle)
    except BaseException:
        if handle is not None:
            handle.stop()
        serves.state = "down"
        _save_serves(serves)
        raise
    serves.base_url, serves.state, serves.ready_at = handle.cluster.base_url, "up", time.time()
    _save_serves(serves)
    get_logger().info(f"cluster {name} up on {serves.base_url}: {serves.base_model}, LoRA rank <= "
                      f"{serves.max_lora_rank}, {serves.lora_adapters - 1} adapter slots")
    return handle


def hold(handle: ClusterHandle, name: str, cfg: RunConfig | None = None,
         stop_when=lambda: False) -> list[ProcessRecord]:
    """Keep the cluster until SIGTERM or SIGINT (`down`), `stop_when()`, or a process of it dies, releasing the
    attached runs that die without their teardown (`reap`; `cfg`: the config it was started with, which names
    a database it was given); then stop it. Returns its records with their exit codes."""
    stopping = []
    previous = {}
    if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
        previous = {s: signal.signal(s, lambda *_: stopping.append(True)) for s in (signal.SIGTERM, signal.SIGINT)}
    next_reap, failed_reaps = 0.0, set()
    try:
        while not stopping and not stop_when() and not handle.monitor.failed.is_set():
            if time.monotonic() >= next_reap:
                reap(name, handle, cfg, failed_reaps)
                next_reap = time.monotonic() + REAP_INTERVAL_S
            handle.monitor.failed.wait(0.2)
        if handle.monitor.failures:
            cause = handle.monitor.first_failure()
            get_logger().error(f"cluster {name}: {cause.message.splitlines()[0]}; stopping it")
            serves = load_serves(name)
            if serves is not None:  # before the stop, whose own deaths an attached run would see next
                serves.failure = {"rank": cause.rank, "role": cause.role, "exit_code": cause.exit_code,
                                  "message": cause.message.splitlines()[0]}
                _save_serves(serves)
    finally:
        records = stop(handle, name)
        for s, h in previous.items():
            signal.signal(s, h)
    return records


def reap(name: str, handle: ClusterHandle, cfg: RunConfig | None = None, failed: set[str] | None = None) -> list[str]:
    """Release the runs attached to the cluster whose process is gone without its teardown (SIGKILL, out of
    memory): what their key holds unloaded, their staging removed, their key revoked, as their `release` would
    have; the engine itself would free their slots only when their sessions time out, minutes later. Run by the
    holder with the cluster's own key; a run on another machine is left alone (its process cannot be seen from
    here). Returns the run ids released; a failure is tried again at the next call, logged the first time (the
    digests in `failed`)."""
    directory = cluster_dir(name)
    gone = {digest: record for digest, record in _read_keys(directory).items()
            if record.get("kind", "run") == "run" and record.get("pid") is not None and not _holder_alive(record)}
    if not gone:
        return []
    log = get_logger()
    serves = load_serves(name)
    base, key = handle.cluster.base_url, handle.cluster.api_key.get_secret_value()
    reaped = []
    for digest, record in gone.items():
        try:
            response = httpx.get(f"{base}{OWNED_PATH}", params={"owner": digest}, headers={"X-API-Key": key},
                                 timeout=10)
            response.raise_for_status()
            unloaded = _free(name, base, key, database_url(serves, cfg), response.json()["sessions"],
                             Path(handle.cluster.checkpoints_base))
        except Exception as exc:  # the API busy or going: the next call tries again
            if failed is None or digest not in failed:
                log.warning(f"cluster {name}: could not release run {record['owner']}, whose process is gone "
                            f"({exc}); trying again")
            if failed is not None:
                failed.add(digest)
            continue
        with _locked_keys(directory) as keys:
            keys.pop(digest, None)
        reaped.append(record["owner"])
        log.info(f"cluster {name}: run {record['owner']} (pid {record['pid']}) is gone without its teardown: "
                 f"{len(unloaded)} model(s) unloaded, its key revoked")
    return reaped


def stop(handle: ClusterHandle, name: str) -> list[ProcessRecord]:
    """Stop the named cluster this process holds, and record it down."""
    records = handle.stop()
    serves = load_serves(name)
    if serves is not None:
        serves.state = "down"
        _save_serves(serves)
    return records


def down(name: str, timeout_s: float = 30.0) -> list[ProcessRecord]:
    """Stop the named cluster: its holder stops it; a holder that is gone or does not stop in time, from
    cluster.json."""
    from txflow.cluster.launchers import stop_cluster

    serves = load_serves(name)
    if serves is None:
        raise AttachFailed(f"no cluster named {name} under {clusters_dir()}")
    if holder_alive(serves):
        os.kill(serves.holder_pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while holder_alive(serves) and time.monotonic() < deadline:
            time.sleep(0.1)
    records = stop_cluster(cluster_dir(name))
    serves = load_serves(name)
    if serves is not None and serves.state != "down":
        serves.state = "down"
        _save_serves(serves)
    return records


def database_url(serves: Serves, cfg: RunConfig | None = None) -> str:
    if serves.sqlite:
        return f"sqlite:///{cluster_dir(serves.name) / 'tinker.db'}"
    if cfg is not None and cfg.database_url is not None:
        return cfg.database_url.get_secret_value()
    raise AttachFailed(f"cluster {serves.name} keeps its state in a database it was given: give the run the same "
                       f"one (TXFLOW_DATABASE_URL)")


def loaded_models(db_url: str, session_ids: list[str] | None = None, unloading: bool | None = True) -> list[str]:
    """The models the engine holds (not unloaded; being unloaded too unless `unloading` is False), of
    `session_ids` only when given; with `unloading` None, every model of `session_ids`, unloaded or not.
    A model whose creation failed (the engine refused it, every slot held) keeps its row but no slot."""
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT m.model_id, m.session_id, m.status FROM models m LEFT JOIN futures f "
                "ON f.request_id = m.request_id WHERE f.status IS NULL OR upper(f.status) != 'FAILED'")).all()
    finally:
        engine.dispose()

    def wanted(session: str, status: str) -> bool:
        if session_ids is not None and session not in session_ids:
            return False
        return unloading is None or (status != "unloaded" and (unloading or status != "unloading"))

    return [m for m, s, status in rows if wanted(s, status)]


def free_slots(serves: Serves, db_url: str) -> int:
    """Adapter slots no model holds (slot 0 is the base model's)."""
    try:
        used = len(loaded_models(db_url))
    except Exception:  # no tables yet: nothing is loaded
        used = 0
    return serves.lora_adapters - 1 - used


def _processes_alive(name: str) -> bool:
    try:
        cluster = Cluster.load(cluster_dir(name))
    except FileNotFoundError:
        return False
    if cluster.launcher == "ray":  # ranks on other nodes, pids of other machines: only their actors can tell
        return bool(cluster.processes) and _actors_say_alive(cluster)
    return bool(cluster.processes) and all(procfs.is_alive(p.pid, p.start_time) for p in cluster.processes
                                           if p.host == cluster.host and p.actor is None)


def _actors_say_alive(cluster: Cluster) -> bool:
    from txflow.cluster.launchers import get_launcher

    launcher = get_launcher(cluster=cluster)
    try:
        return all(launcher.exit_code(p) is None for p in cluster.processes)
    except (LostProcess, ConnectionError):  # a rank's actor gone, or Ray itself
        return False


def healthy(serves: Serves) -> bool:
    if serves.state != "up" or not holder_alive(serves) or not _processes_alive(serves.name):
        return False
    try:
        return httpx.get(f"{serves.base_url}/api/v1/healthz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def status(name: str) -> dict:
    """What `txflow cluster status` shows: what the cluster serves, whether it is healthy, free slots and the
    runs attached."""
    serves = load_serves(name)
    if serves is None:
        raise AttachFailed(f"no cluster named {name} under {clusters_dir()}")
    ok = healthy(serves)
    out = serves.model_dump(exclude={"sqlite"})
    out["healthy"] = ok
    out["free_slots"] = free_slots(serves, database_url(serves)) if ok and serves.sqlite else None
    out["attached_runs"] = sorted({r["owner"] for r in _read_keys(cluster_dir(name)).values()
                                   if r.get("kind", "run") == "run" and _holder_alive(r, unknown=True)}) if ok else []
    return out


# --- the run's side ------------------------------------------------------------------------------------


@contextmanager
def _locked_keys(directory: Path):
    """The run-keys file, read and rewritten under an exclusive lock (runs attach and release at once)."""
    with open(directory / (RUN_KEYS + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        keys = _read_keys(directory)
        yield keys
        _write_private(directory / RUN_KEYS, json.dumps(keys))


def _read_keys(directory: Path) -> dict[str, dict]:
    """`{digest: record}`: a run's key (`kind` run: `owner` its run id, `pid`/`start` the process that
    attached) or a key given out (`kind` key: `owner` its label, `expires`); the API reads `expires` too."""
    try:
        keys = json.loads((directory / RUN_KEYS).read_text() or "{}")
    except (FileNotFoundError, ValueError):
        return {}
    return {digest: record if isinstance(record, dict) else {"owner": record, "kind": "run"}
            for digest, record in keys.items()}


def _holder_alive(record: dict, unknown: bool = False) -> bool:
    """Whether the process that attached with a run key still runs; `unknown` for a record without one. A
    process on another machine (`host`) counts as alive: only that machine could tell."""
    if record.get("pid") is None:
        return unknown
    if record.get("host", socket.gethostname()) != socket.gethostname():
        return True
    return procfs.is_alive(record["pid"], record.get("start"))


def revoke(name: str, run_id: str) -> None:
    """Take every key of `run_id` out of the cluster's run keys (a cancellation hook, which has no key)."""
    directory = cluster_dir(name)
    if not directory.exists():
        return
    with _locked_keys(directory) as keys:
        for digest in [d for d, r in keys.items() if r.get("kind", "run") == "run" and r["owner"] == run_id]:
            del keys[digest]


# --- keys given out: a notebook's, any process's ---------------------------------------------------------


def issue_key(name: str, label: str, ttl_s: float) -> tuple[str, Serves]:
    """A key for `label` on the named cluster, valid `ttl_s` seconds: scoped as a run's is (it reaches only
    what it creates), revocable (`revoke_key`). Returns the key (shown once; the cluster keeps its digest)."""
    if not re.fullmatch(RUN_ID_PATTERN, label):  # shown and typed as a name is
        raise AttachFailed(f"--label {label!r} must be 1-64 letters, digits, '-' or '_'")
    if ttl_s <= 0:
        raise AttachFailed(f"--ttl must be positive, got {ttl_s:g} s")
    serves = load_serves(name)
    if serves is None or not healthy(serves):
        raise AttachFailed(f"cluster {name} is not up; start it with `txflow cluster up {name}`")
    key = "tml-" + secrets.token_hex(16)
    now = time.time()
    with _locked_keys(cluster_dir(name)) as keys:
        for digest, record in list(keys.items()):
            if record.get("kind") == "key" and record.get("expires", now) <= now:
                del keys[digest]  # expired: the API refuses it already
        if any(r.get("kind") == "key" and r["owner"] == label for r in keys.values()):
            raise AttachFailed(f"cluster {name} has a key labelled {label} already; revoke it first "
                               f"(`txflow cluster keys {name} --revoke {label}`) or pick another --label")
        keys[key_digest(key)] = {"owner": label, "kind": "key", "created": now, "expires": now + ttl_s}
    return key, serves


def list_keys(name: str) -> list[dict]:
    """The keys given out on the named cluster (label, created, expires, expired) and the runs attached."""
    if load_serves(name) is None:
        raise AttachFailed(f"no cluster named {name} under {clusters_dir()}")
    now = time.time()
    rows = [{"label": r["owner"], "kind": r.get("kind", "run"), "created": r.get("created"),
             "expires": r.get("expires"), "expired": r.get("expires") is not None and r["expires"] <= now}
            for r in _read_keys(cluster_dir(name)).values()]
    return sorted(rows, key=lambda r: (r["kind"], r["label"]))


def revoke_key(name: str, label: str) -> bool:
    """Revoke the key given out as `label`: the API refuses it from its next request (401); its models'
    adapter slots free when their session's heartbeats stop. False when no such key."""
    if load_serves(name) is None:
        raise AttachFailed(f"no cluster named {name} under {clusters_dir()}")
    with _locked_keys(cluster_dir(name)) as keys:
        found = [d for d, r in keys.items() if r.get("kind") == "key" and r["owner"] == label]
        for digest in found:
            del keys[digest]
    return bool(found)


def attached_config(cfg: RunConfig) -> RunConfig:
    """The run's config with the cluster's database (checkpoints are registered there), when it has none."""
    serves = load_serves(cfg.cluster)
    if serves is None or cfg.database_url is not None:
        return cfg
    return cfg.model_copy(update={"database_url": SecretStr(database_url(serves, cfg))})


def check(cfg: RunConfig, base_model_path: str) -> Serves:
    """Pre-flight: the named cluster exists and serves this run's base model (`base_model_path`, resolved by
    the run's pre-flight) and LoRA rank (one line if not)."""
    name = cfg.cluster
    serves = load_serves(name)
    if serves is None:
        raise AttachFailed(f"--cluster {name}: no such cluster under {clusters_dir()}; start one with "
                           f"`txflow cluster up {name} --base-model {cfg.base_model}`")
    if serves.base_model != cfg.base_model and serves.base_model_path != base_model_path:
        raise AttachFailed(f"--cluster {name} serves {serves.base_model}, not --base-model {cfg.base_model}")
    if cfg.lora_rank > serves.max_lora_rank:
        raise AttachFailed(f"--cluster {name} takes LoRA ranks up to {serves.max_lora_rank}, not --lora-rank "
                           f"{cfg.lora_rank}")
    return serves


class _Watch:
    """What an attached run's monitor asks about the cluster's processes: alive (on this machine, by /proc;
    on Ray, by their actors) or gone; the holder that keeps the cluster counts as one of them. A process
    the holder stopped because another died is no death of its own: the other one is named."""

    name = "attached"

    def __init__(self, serves: Serves, launcher):
        self.serves, self.launcher = serves, launcher

    def exit_code(self, record: ProcessRecord) -> int | None:
        try:
            if not holder_alive(self.serves):
                raise LostProcess(f"the holder of cluster {self.serves.name} (pid {self.serves.holder_pid}) is gone")
            code = self.launcher.exit_code(record)
        except LostProcess as exc:
            code, lost = None, exc
        else:
            if code is None:
                return None
            lost = None
        now = load_serves(self.serves.name)
        cause = now.failure if now is not None and now.holder_pid == self.serves.holder_pid else None
        if cause is None:
            if lost is not None:
                raise lost
            return code
        if (cause["rank"], cause["role"]) != (record.rank, record.role):
            return None  # stopped by the holder because of the cause, which this monitor records instead
        if code is None and cause["exit_code"] is None:
            raise LostProcess(f"gone (the holder of cluster {self.serves.name} saw: {cause['message']})")
        return code if code is not None else cause["exit_code"]

    def tail(self, record, lines=30):
        return self.launcher.tail(record, lines)

    def stop(self, cluster, grace_s=5.0):  # an attached run never stops the cluster
        return cluster.processes


def _register_run_key(cfg: RunConfig, key: str) -> None:
    """The run's key in the cluster's run keys, with what tells the holder whether the run's process lives
    (pid, start time, host); refused while a run of this id attaches from another live process."""
    with _locked_keys(cluster_dir(cfg.cluster)) as keys:
        for record in keys.values():
            if (record.get("kind", "run") == "run" and record["owner"] == cfg.run_id
                    and record.get("pid") != os.getpid() and _holder_alive(record)):
                raise AttachFailed(f"run id {cfg.run_id} is attached to cluster {cfg.cluster} already (pid "
                                   f"{record['pid']}); give this run another --run-id")
        # A key of a run of this id that died without its teardown, or of this process's earlier attach, stays:
        # only the holder may ask what another key holds (the cluster's key), and its `reap` unloads that and
        # revokes the key once the key's process is gone. Forgotten here, the key's models would hold their slots
        # until the engine timed out their sessions.
        keys[key_digest(key)] = {"owner": cfg.run_id, "kind": "run", "pid": os.getpid(),
                                 "start": procfs.start_time(os.getpid()), "host": socket.gethostname(),
                                 "created": time.time()}


def attach(cfg: RunConfig, base_model_path: str) -> ClusterHandle:
    """provision-coordinator of an attached run (its base model at `base_model_path`, as its pre-flight resolved
    it): a key of its own on the cluster, and a handle whose monitor watches the cluster's processes (their death
    is this run's cluster fault, named)."""
    from txflow.cluster.launchers import get_launcher

    serves = check(cfg, base_model_path)
    deadline = time.monotonic() + cfg.startup_timeout_s
    while not healthy(serves):  # a cluster being (re)started: wait for it, bounded
        if time.monotonic() > deadline:
            raise AttachFailed(f"--cluster {cfg.cluster} is not up (state {serves.state}) within "
                               f"{cfg.startup_timeout_s:.0f} s; start it with `txflow cluster up {cfg.cluster}`")
        time.sleep(0.2)
        serves = load_serves(cfg.cluster) or serves
    (Path(cfg.state_dir) / "logs").mkdir(parents=True, exist_ok=True)  # the run's own state: metrics, logs
    cluster = Cluster.load(cluster_dir(cfg.cluster))
    # Always a fresh key: one given to the run (TINKER_API_KEY) may be another run's too.
    key = "tml-" + secrets.token_hex(16)
    register_secret(key)
    cluster.api_key = SecretStr(key)
    _register_run_key(cfg, key)
    handle = ClusterHandle.watch(cluster, _Watch(serves, get_launcher(cluster=cluster)))
    handle.compiles.skip_past()
    handle.shared, handle.release = cfg.cluster, release
    get_logger().info(f"run {cfg.run_id} attached to cluster {cfg.cluster} on {cluster.base_url} "
                      f"({serves.base_model})")
    return handle


def verify(cfg: RunConfig, handle: ClusterHandle) -> ClusterHandle:
    """launch-workers of an attached run: the cluster answers and has an adapter slot free (waiting for one up
    to `startup_timeout_s`)."""
    serves = load_serves(cfg.cluster)
    db_url = database_url(serves, cfg)
    deadline = time.monotonic() + cfg.startup_timeout_s
    waited = False
    while True:
        handle.monitor.raise_if_failed()
        if free_slots(serves, db_url) >= 1:
            break
        if time.monotonic() > deadline:
            raise AttachFailed(f"--cluster {cfg.cluster}: no free adapter slot within {cfg.startup_timeout_s:.0f} s "
                               f"(all {serves.lora_adapters - 1} held); retry later or start it with more "
                               f"--lora-adapters")
        if not waited:
            get_logger().info(f"cluster {cfg.cluster}: every adapter slot is held; waiting for one")
            waited = True
        time.sleep(0.5)
    response = httpx.get(f"{handle.cluster.base_url}/api/v1/healthz", timeout=5.0)
    if response.status_code != 200:
        raise AttachFailed(f"--cluster {cfg.cluster}: its API answers {response.status_code} on /healthz")
    return handle


def owned(handle: ClusterHandle) -> dict[str, list[str]]:
    """What the run's key holds on the shared cluster, as its API recorded it: `sessions` and `models`, its
    own clients' and those of a custom client it started with that key."""
    response = httpx.get(f"{handle.cluster.base_url}{OWNED_PATH}",
                         headers={"X-API-Key": handle.cluster.api_key.get_secret_value()}, timeout=10)
    response.raise_for_status()
    return response.json()


def release(handle: ClusterHandle, db_url: str | None = None) -> list[ProcessRecord]:
    """Teardown of an attached run: unload its models, drop their staging, revoke its key; the cluster stays."""
    log = get_logger()
    name = handle.shared
    sessions = set(handle.sessions)
    try:  # a custom client's sessions too: it used the run's key, not txflow's clients
        sessions |= set(owned(handle)["sessions"])
    except (httpx.HTTPError, ValueError, KeyError) as exc:  # a dead cluster: its adapters went with it
        log.warning(f"cluster {name}: could not list what the run's key holds ({exc})")
    sessions = sorted(sessions)
    handle.close_clients()
    handle.monitor.stop()
    if handle.waiters is not None:
        handle.waiters.shutdown(wait=False, cancel_futures=True)
    serves = load_serves(name)
    unloaded = []
    if serves is not None and sessions:
        unloaded = _free(name, handle.cluster.base_url, handle.cluster.api_key.get_secret_value(),
                         db_url or database_url(serves), sessions, Path(handle.cluster.checkpoints_base))
    with _locked_keys(cluster_dir(name)) as keys:  # this attach's key only: never another of the run id
        keys.pop(key_digest(handle.cluster.api_key.get_secret_value()), None)
    alive = serves is not None and healthy(serves)
    log.info(f"released from cluster {name}: {len(unloaded)} model(s) unloaded, the run's key revoked; "
             + ("the cluster stays up" if alive else "the cluster is down (not this run's to restart)"))
    return []


def _free(name: str, base_url: str, key: str, db_url: str, sessions: list[str], staging: Path) -> list[str]:
    """Unload the models of `sessions` still loaded (with `key`: the run's own, or the cluster's) and remove the
    staging of every model they had; returns the models unloaded. What fails is logged: a dead cluster's
    adapters went with it."""
    log = get_logger()
    try:
        models = loaded_models(db_url, sessions, unloading=False)
        every = loaded_models(db_url, sessions, unloading=None)
    except Exception as exc:  # no database (a cluster never up): nothing of the run's is loaded
        log.warning(f"cluster {name}: could not list the run's models ({exc})")
        models, every = [], []
    unloaded = []
    for model_id in models:
        try:
            httpx.post(f"{base_url}/api/v1/unload_model", json={"model_id": model_id, "type": "unload_model"},
                       headers={"X-API-Key": key}, timeout=10).raise_for_status()
            unloaded.append(model_id)
        except Exception as exc:
            log.warning(f"cluster {name}: could not unload {model_id} ({exc})")
    for model_id in every:  # committed already, or imported from the durable copy: staging only
        _remove_tree(staging / model_id)
    return unloaded


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
