"""The start-up sequence of a cluster: provision (the Tinker API server, then rank 0, the engine, which hosts
the JAX coordinator), launch-workers (ranks 1..N-1 once rank 0's process exists, then a readiness
request that every rank takes part in), what every process starts with, and the waits between."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from txflow.checkpoints.storage import fresh_staging
from txflow.cluster.handle import ClusterHandle
from txflow.cluster.launcher import Launcher
from txflow.cluster.monitor import NoProgress
from txflow.cluster.records import Cluster
from txflow.config import RunConfig
from txflow.log import get_logger, register_secret
from txflow.upstream.skyrl_tx import DATABASE_URL_ENV, launch
from txflow.upstream.tiny_model import cache_dir


def child_env(cfg: RunConfig) -> dict[str, str]:
    """What every process of the cluster gets on top of its node's own environment; no credential (the
    launcher hands those by `secret_env` to the processes that use them)."""
    env = {"PYTHONUNBUFFERED": "1",
           # Compiled programs persist across runs: a new cluster skips most of its ~10 s of JIT per rank.
           # An explicit JAX_COMPILATION_CACHE_DIR (or "" to switch it off) wins.
           "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                       str(cache_dir() / "jax-compilation")),
           # Every program, not only those that took 1 s or more: a rank runs ~300 small ones (collectives,
           # random seeds, staging) and compiled each again on every start. An explicit value wins.
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                                                                        "0"),
           # glibc gives threads up to 8 malloc arenas per core, and XLA's thread pool fragments them: a
           # rank's RSS then grows with every step (+320-350 MiB while training 100 SFT steps here, +70 MiB
           # with 2 arenas), and 2 arenas cost no step time we could measure. An explicit MALLOC_ARENA_MAX wins.
           "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")}
    if Path(cfg.base_model).is_dir() or cfg.base_model == "tiny":
        # A local model needs no hub; never let a rank try to reach one.
        env["HF_HUB_OFFLINE"] = "1"
    return env


def wait_for_api(handle: ClusterHandle, timeout_s: float) -> None:
    """Wait until the API answers /healthz (liveness of the API only, not readiness)."""
    cluster = handle.cluster
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        handle.monitor.raise_if_failed()
        try:
            if httpx.get(f"{cluster.base_url}/api/v1/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    api = next(p for p in cluster.processes if p.role == "api")
    raise NoProgress(f"The Tinker API server did not answer on {cluster.base_url} within {timeout_s:.0f} s. "
                     f"Last lines of {api.log}:\n{handle.launcher.tail(api)}")


def provision(cfg: RunConfig, launcher: Launcher, base_model_path: str,
              api_env: dict[str, str] | None = None) -> ClusterHandle:
    """Start the API server, then rank 0, without waiting for either (`launch_workers` proves them ready);
    each is in cluster.json as soon as it exists, and a monitor watches them from the start. A failure
    stops what this call started, so that a retry starts from nothing. `base_model_path`: what the engine
    loads, as pre-flight resolved it. `api_env`: more environment for the API (a shared cluster's run-keys
    file)."""
    log = get_logger()
    state_dir = Path(cfg.state_dir)
    (state_dir / "logs").mkdir(parents=True, exist_ok=True)
    db_url = cfg.resolved_database_url()
    cluster = Cluster(
        run_id=cfg.run_id,
        launcher=cfg.launcher,
        state_dir=str(state_dir),
        host=cfg.host,
        api_port=0,
        coordinator_port=None,
        num_processes=cfg.processes,
        base_model_path=base_model_path,
        checkpoints_base=fresh_staging(cfg),
        **({"api_key": cfg.api_key} if cfg.api_key is not None else {}),
    )
    register_secret(cluster.api_key.get_secret_value())
    handle = None
    try:
        launcher.place(cluster, cfg.host)
        handle = ClusterHandle.watch(cluster, launcher)
        engine_argv = launch.engine_args(cfg, cluster.base_model_path, cluster.checkpoints_base,
                                         cluster.coordinator_address)
        env = child_env(cfg) | launch.wake_env()  # the API and the engine wake each other
        # The API first (it creates the database tables), then rank 0 without waiting for it: the
        # engine waits for the tables itself after its imports (the `self-gated-startup` change). Both use the database;
        # the API alone gets the run's key, which it checks on every request (the `api-key-check` change).
        database = {DATABASE_URL_ENV: db_url}
        api_env = (env | launch.api_limits_env(cfg) | launch.served_model_env(cfg, cluster.base_model_path)
                   | (api_env or {}))
        api = launcher.start(cluster, "api", None, launch.api_command(engine_argv, cluster.host, cluster.api_port),
                             api_env, {"http": cluster.api_port}, "api",
                             secret_env=database | launch.api_key_env(cluster.api_key.get_secret_value()))
        log.info(f"Tinker API server pid {api.pid} on {cluster.base_url}, log {api.log}")
        ports = {"coordinator": cluster.coordinator_port} if cluster.coordinator_port else {}
        rank0_env = env | launch.coordinator_env(cluster.coordinator_address)
        rank0 = launcher.start(cluster, "coordinator", 0, launch.engine_command(engine_argv), rank0_env,
                               ports, "rank0", secret_env=database)
        log.info(
            f"rank 0 (engine{', JAX coordinator ' + cluster.coordinator_address if cluster.coordinator_port else ''}) "
            f"pid {rank0.pid}, log {rank0.log}; command: {' '.join(launch.engine_command(engine_argv))}"
        )
    except BaseException:
        # A retry must start from nothing: stop what this attempt started.
        if handle is not None:
            handle.stop()
        else:
            launcher.stop(cluster)
        raise
    return handle


GREEDY_TOKENS = 8


def greedy_params(seed: int = 0):
    """The sampling of every evaluation: greedy, GREEDY_TOKENS tokens, with the prompt's logprobs. One shape,
    so the engine compiles one program for them all, the readiness sample included."""
    from txflow.upstream.tinker_sdk import tinker

    return tinker.types.SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, seed=seed)


def greedy_answers(sampler, prompts: list[list[int]], handle: ClusterHandle, timeout_s: float, seed: int = 0,
                   what: str = "a greedy sample") -> list:
    """Every prompt sampled greedily (`greedy_params`, with its prompt's logprobs), all requests in flight together
    so that the engine takes them into one batch; the responses, in the prompts' order."""
    from txflow.upstream.tinker_sdk import tinker

    futures = [sampler.sample(prompt=tinker.types.ModelInput.from_ints(prompt), num_samples=1,
                              sampling_params=greedy_params(seed), include_prompt_logprobs=True) for prompt in prompts]
    return [handle.wait(future, what, timeout_s) for future in futures]


def missing_ranks(handle: ClusterHandle) -> list[str]:
    """Ranks whose log lacks the line they print once they take part in collectives."""
    missing = []
    for record in handle.cluster.processes:
        if record.role == "api":
            continue
        marker = launch.RANK_READY_MARKERS["engine" if record.rank == 0 else "worker"]
        log_text = handle.launcher.tail(record, lines=10_000)
        if marker not in log_text:
            missing.append(f"rank {record.rank} (pid {record.pid}); last lines of {record.log}:\n"
                           + "\n".join(log_text.splitlines()[-30:]))
    return missing


# The readiness sample takes the run's held-out prompts when there are at most this many: the engine samples calls
# that ask for prompt logprobs 32 rows at a time (`sampling-rows`), so they cost it no more than its one prompt did.
READINESS_PROMPTS = 32


def prove_ready(handle: ClusterHandle, timeout_s: float, prompts: list[list[int]] | None = None,
                seed: int = 0) -> tuple[float, list[list[int]] | None]:
    """A greedy sample from the base model: every rank takes part in it. It has the shape of the greedy samples the
    evaluations take later, so the program it compiles is compiled once. Given `prompts` (a run's held-out prompts,
    at most READINESS_PROMPTS), it samples those: (seconds, the base model's greedy tokens of each), else one
    prompt of three tokens: (seconds, None)."""
    started = time.monotonic()
    asked = prompts if prompts and len(prompts) <= READINESS_PROMPTS else None
    client = handle.service_client()
    try:
        answers = greedy_answers(handle.base_sampler(client, timeout_s), asked or [[1, 2, 3]], handle, timeout_s,
                                 seed, "the readiness sample")
    except NoProgress as exc:
        missing = missing_ranks(handle)
        detail = "\n".join(missing) if missing else "every rank logged that it joined; the engine did not answer"
        raise NoProgress(f"Cluster not ready within {timeout_s:.0f} s. Not ready: {detail}") from exc
    tokens = [list(answer.sequences[0].tokens) for answer in answers] if asked else None
    return time.monotonic() - started, tokens


def launch_workers(cfg: RunConfig, handle: ClusterHandle, prompts: list[list[int]] | None = None,
                   seed: int = 0) -> list[list[int]] | None:
    """Start every rank > 0 now that rank 0's process exists, then prove the whole cluster serves a request: a greedy
    sample of `prompts` when they fit one batch (see `prove_ready`). Returns the base model's greedy tokens of
    `prompts`, or None when the readiness sampled a prompt of its own."""
    log = get_logger()
    cluster = handle.cluster
    handle.monitor.raise_if_failed()
    if cfg.processes > 1:
        # The gate is rank 0's process; each worker then waits after its imports until rank 0's
        # coordinator accepts connections (the `self-gated-startup` change), instead of leaning on JAX's retries.
        log.info(f"rank 0 pid {cluster.rank(0).pid} runs; starting ranks 1..{cfg.processes - 1}, each joining "
                 f"once the coordinator {cluster.coordinator_address} accepts connections")
        env = child_env(cfg)  # no credential: a worker gets its work from rank 0, never from the database
        for rank in range(1, cfg.processes):
            cmd = launch.worker_command(cluster.coordinator_address, cfg.processes, rank,
                                               cfg.startup_timeout_s)
            record = handle.launcher.start(cluster, "worker", rank, cmd, env, {}, f"rank{rank}")
            log.info(f"rank {rank} (JAX worker) pid {record.pid}, log {record.log}")
    wait_for_api(handle, cfg.startup_timeout_s)
    seconds, tokens = prove_ready(handle, cfg.startup_timeout_s, prompts, seed)
    log.info(f"cluster ready: all {cfg.processes} ranks served a greedy sample ({seconds:.1f} s"
             + (f", the base model's answers to {len(tokens)} held-out prompts)" if tokens else ")"))
    return tokens
