"""The Ray launcher: each rank placed by a Ray actor on its own node of an existing Ray cluster.

- One placement group per cluster, one bundle per rank (`ray_placement`,
  STRICT_SPREAD by default: one rank per node). Bundle 0 is pinned to the
  driver's node by a node-id label selector: rank 0 and the Tinker API run
  there, so the checkpoint staging directory, the SQLite database and every
  checkpoint file are on the machine where txflow commits and imports them.
- One actor per bundle (`RankHost`), not detached: if the driver dies, Ray
  removes its actors and placement group. The actor starts its rank (and, on
  bundle 0, the API) as a plain subprocess in its own process group; the rank
  watches its parent, the actor, through the lifeline (`txflow.processes.lifeline`), so
  it dies with the actor whatever kills it (`ray.kill` alone would leave it).
- Control calls (status, log tail, stop) run in a concurrency group of their
  own, so they answer while an actor is blocked waiting for its rank to exit.
  That wait is how the monitor learns of a death without polling: each start
  leaves a `wait_exit` call in flight, which returns the exit code, or fails
  when the actor or its node is lost.
- Nothing secret reaches Ray: actor names, constructor and call arguments and
  the runtime env hold none (Ray keeps a task's arguments where any driver or
  the state API can read them, constructor arguments in the GCS). Credentials
  go to rank 0's node only, the driver's own: the driver writes them to a file
  of its private state directory (0600), names the file in the `start` call,
  and the actor reads and deletes it before it starts the process, which gets
  them by environment. The ranks on other nodes use no credential.
- The API's port is bound by actor 0 on its node (`listen`) and stays bound
  until the API inherits the socket, as with the local launcher.
- `cluster.json` records what a hook in another process needs to stop the
  cluster by name: address, namespace, placement group, actors, nodes.

Ray quirks this works around, each with how to tell when it can go:

1. Ray SIGKILLs the direct children of an exiting worker
   (`kill_child_processes_on_worker_exit`): the rank would die before its own
   lifeline can stop its process group. Off for the actors (runtime env), the
   lifeline does it. Can go if Ray kills the whole process group instead.
2. `--node-ip-address 127.0.0.1` is rewritten to the machine's outward address
   and every Ray listener binds every interface: nothing here can keep Ray on
   loopback. The API and the JAX coordinator bind to their node's address, never
   0.0.0.0; tests run Ray inside a private network namespace.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import ray
from ray.util import get_placement_group
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from txflow.cluster.launcher import Launcher, LostProcess, PlacementFailed
from txflow.cluster.records import Cluster, ProcessRecord
from txflow.config import environ_without_secrets
from txflow.processes import groups, lifeline, logs, ports, procfs, umask

NAMESPACE = "txflow"
ADDRESS_ENV = "RAY_ADDRESS"
CONTROL_TIMEOUT_S = 5.0
RUNTIME_ENV = {"env_vars": {"RAY_kill_child_processes_on_worker_exit": "false"}}  # quirk 1


@ray.remote(concurrency_groups={"wait": 4, "control": 2})
class RankHost:
    """Hosts the processes of one bundle on its node: starts them, waits for them, stops them."""

    def __init__(self):
        # The actor has the raylet's mask (022 as a rule): its ranks' logs, the database and the checkpoints
        # they write would be readable by every local user. The actor's worker process is its own and dies
        # with it, so its mask is set once, for it and every process it starts, as `txflow run` does.
        os.umask(umask.PRIVATE)
        self.procs: dict[int, subprocess.Popen] = {}
        self.api_socket = None  # bound by listen, handed to the API by start

    @ray.method(concurrency_group="control")
    def listen(self) -> int:
        """Bind the API's port on this node, kept bound until `start` hands the socket to the API."""
        if self.api_socket is not None:
            self.api_socket.close()
        self.api_socket = ports.listener(ray.util.get_node_ip_address())
        return self.api_socket.getsockname()[1]

    @ray.method(concurrency_group="control")
    def node(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}

    @ray.method(concurrency_group="control")
    def free_port(self) -> int:
        return ports.free_port(ray.util.get_node_ip_address())

    @ray.method(concurrency_group="control")
    def start(self, cmd: list[str], env: dict[str, str], log: str, secret_file: str | None = None,
              api: bool = False) -> dict:
        """`cmd` (its interpreter replaced by this node's) in its own process group, dying with this actor;
        with the credentials in `secret_file` (read, then deleted) in its environment, and for the `api`
        the socket `listen` bound."""
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        secret_env = {}
        if secret_file:
            try:
                secret_env = json.loads(Path(secret_file).read_text())
            finally:
                Path(secret_file).unlink(missing_ok=True)
        full_env = {**environ_without_secrets(), **env, **secret_env}
        inherited = (self.api_socket.fileno(),) if api and self.api_socket is not None else ()
        if inherited:
            full_env[ports.LISTEN_FD_ENV] = str(inherited[0])
        try:
            proc = groups.spawn([sys.executable, *cmd[1:]], Path(log), env=lifeline.child_env(full_env),
                                pass_fds=inherited)
        finally:
            if inherited:
                self.api_socket.close()
                self.api_socket = None
        self.procs[proc.pid] = proc
        return {"pid": proc.pid, "start_time": procfs.start_time(proc.pid)}

    @ray.method(concurrency_group="wait")
    def wait_exit(self, pid: int) -> int:
        return self.procs[pid].wait()

    @ray.method(concurrency_group="control")
    def status(self, pid: int) -> int | None:
        return self.procs[pid].poll()  # a pid this actor did not start: KeyError, not an invented code

    @ray.method(concurrency_group="control")
    def tail(self, log: str, lines: int) -> str:
        return logs.tail(log, lines)

    @ray.method(concurrency_group="control")
    def stop(self, grace_s: float) -> dict[int, int | None]:
        groups.stop_groups(list(self.procs), grace_s)
        # wait(), not poll(): poll() answers None while the "wait" group's thread holds the process.
        return {pid: proc.wait(timeout=5) for pid, proc in self.procs.items()}


def _secret_file(state_dir: str, secret_env: dict[str, str]) -> Path:
    """`secret_env` as a new file only this user can read, in the run's state directory on this node (bundle
    0's, pinned here): how credentials reach actor 0 without being a Ray argument."""
    path = Path(state_dir) / f".secret-env-{secrets.token_hex(8)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(secret_env, f)
    return path


def connect(address: str | None) -> str:
    """Join the Ray cluster at `address` (or RAY_ADDRESS) as a driver; never starts one."""
    address = address or os.environ.get(ADDRESS_ENV)
    if not address:
        raise PlacementFailed(f"--launcher ray needs a Ray cluster: pass --ray-address HOST:PORT or set {ADDRESS_ENV}"
                              f" (txflow does not start a Ray cluster of its own)")
    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="WARNING")
    return address


class RayLauncher(Launcher):
    """Places a cluster's processes on Ray actors; see the module docstring."""

    name = "ray"

    def __init__(self, address: str | None = None, cpus_per_rank: float = 1, gpus_per_rank: float = 0,
                 strategy: str = "STRICT_SPREAD", timeout_s: float = 300, namespace: str = NAMESPACE):
        self.address, self.cpus, self.gpus = address, cpus_per_rank, gpus_per_rank
        self.namespace = namespace  # where the actors live: the recorded one for a cluster placed earlier
        self.strategy, self.timeout_s = strategy, timeout_s
        self._actors: dict[str, object] = {}
        self._exits: dict[int, object] = {}  # id(record) -> its wait_exit call

    @classmethod
    def for_config(cls, cfg) -> RayLauncher:
        return cls(cfg.ray.address, cfg.ray.cpus_per_rank, cfg.ray.gpus_per_rank, cfg.ray.placement,
                   cfg.startup_timeout_s)

    @classmethod
    def for_cluster(cls, cluster: Cluster) -> RayLauncher:
        return cls(cluster.launcher_state.get("address"), namespace=cluster.launcher_state.get("namespace", NAMESPACE))

    # --- placing -------------------------------------------------------------------------

    def place(self, cluster: Cluster, host: str) -> None:
        address = connect(self.address)
        generation = time.strftime("%H%M%S") + f"-{os.getpid() % 10000}"
        prefix = f"txflow-{cluster.run_id}-{generation}"
        bundle = {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}
        n = cluster.num_processes
        driver_node = ray.get_runtime_context().get_node_id()
        group = placement_group([dict(bundle) for _ in range(n)], strategy=self.strategy, name=f"{prefix}-pg",
                                bundle_label_selector=[{"ray.io/node-id": driver_node}] + [{}] * (n - 1))
        cluster.launcher_state = {"address": address, "namespace": self.namespace, "placement_group": f"{prefix}-pg",
                                  "actors": [], "node_ids": []}
        cluster.save()  # from here on a hook can find and remove what exists
        try:
            self._wait_placed(group, n, bundle)
            actors = []
            for index in range(n):
                name = f"{prefix}-rank{index}"
                actors.append(RankHost.options(
                    name=name, namespace=self.namespace, num_cpus=0, runtime_env=RUNTIME_ENV,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                ).remote())
                self._actors[name] = actors[-1]
                cluster.launcher_state["actors"].append(name)
            cluster.save()
            nodes = ray.get([a.node.remote() for a in actors], timeout=self.timeout_s)
            cluster.launcher_state["node_ids"] = [n["node_id"] for n in nodes]
            cluster.host = nodes[0]["node_ip"]
            cluster.api_port = ray.get(actors[0].listen.remote(), timeout=CONTROL_TIMEOUT_S)
            cluster.coordinator_port = (ray.get(actors[0].free_port.remote(), timeout=CONTROL_TIMEOUT_S)
                                        if n > 1 else None)
            cluster.launcher_state["nodes"] = nodes
            cluster.save()
        except BaseException:
            self.stop(cluster)
            raise

    def _wait_placed(self, group, n: int, bundle: dict) -> None:
        """Until the group is placed; at once when Ray finds it infeasible, else at the deadline."""
        deadline = time.monotonic() + self.timeout_s
        while not group.wait(timeout_seconds=0.5):
            state = (placement_group_table(group).get("stats") or {}).get("scheduling_state")
            if state == "INFEASIBLE" or time.monotonic() > deadline:
                raise PlacementFailed(self._unplaceable(n, bundle, state))

    def _unplaceable(self, n: int, bundle: dict, state: str | None) -> str:
        alive = [node for node in ray.nodes() if node["Alive"]]
        have = "; ".join(f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]}): "
                         + ", ".join(f"{k} {v:g}" for k, v in sorted(node["Resources"].items())
                                     if k in ("CPU", "GPU", "memory") or k.startswith("accelerator"))
                         for node in alive)
        why = "Ray finds it infeasible" if state == "INFEASIBLE" else f"not within {self.timeout_s:.0f} s"
        return (f"Ray cannot place {n} ranks of {bundle} each with strategy {self.strategy}, rank 0 on this driver's "
                f"node ({why}). The cluster has {len(alive)} alive node(s): {have}. Add nodes, lower "
                f"--ray-cpus-per-rank / --ray-gpus-per-rank, or choose another --ray-placement")

    # --- processes ----------------------------------------------------------------------

    def _actor(self, name: str):
        """The actor called `name`, looked up once in this launcher's namespace. Joins Ray first: a process
        that did not place the cluster (a run attached to a named one, `txflow cluster status`) has not, and
        `ray.get_actor` would raise RaySystemError, which no caller takes for a lost process."""
        if name not in self._actors:
            connect(self.address)
            self._actors[name] = ray.get_actor(name, namespace=self.namespace)
        return self._actors[name]

    def start(self, cluster, role, rank, cmd, env, ports, log_name, secret_env=None):
        index = 0 if role == "api" else rank
        actor = self._actor(cluster.launcher_state["actors"][index])
        log = str(Path(cluster.state_dir) / "logs" / f"{log_name}.log")
        if secret_env and index != 0:
            raise ValueError(f"{role} rank {rank}: credentials go to rank 0's node only (the driver's), never "
                             f"through Ray")
        secret_file = _secret_file(cluster.state_dir, secret_env) if secret_env else None
        try:
            started = ray.get(actor.start.remote(cmd, env, log, secret_file and str(secret_file), role == "api"),
                              timeout=CONTROL_TIMEOUT_S)
        finally:
            if secret_file:
                secret_file.unlink(missing_ok=True)  # read and deleted by the actor, unless it failed first
        node = cluster.launcher_state["nodes"][index]
        record = ProcessRecord(role=role, rank=rank, pid=started["pid"], start_time=started["start_time"],
                               host=node["node_ip"], ports=ports, log=log, node_id=node["node_id"],
                               actor=cluster.launcher_state["actors"][index])
        self._exits[id(record)] = actor.wait_exit.remote(started["pid"])
        cluster.processes.append(record)
        cluster.save()
        return record

    def exit_code(self, record):
        pending = self._exits.get(id(record))
        try:
            if pending is not None:
                done, _ = ray.wait([pending], timeout=0)
                return ray.get(done[0]) if done else None
            actor = self._actor(record.actor)
            return ray.get(actor.status.remote(record.pid), timeout=CONTROL_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ValueError) as exc:
            raise LostProcess(f"its Ray actor {record.actor} on node {record.host} ({(record.node_id or '')[:8]}) is "
                              f"gone: the node was lost or the actor died ({type(exc).__name__})") from None
        except ray.exceptions.RayTaskError:
            raise LostProcess(f"its Ray actor {record.actor} does not know pid {record.pid}") from None
        except ray.exceptions.GetTimeoutError:
            return None

    def tail(self, record, lines=30):
        try:
            return ray.get(self._actor(record.actor).tail.remote(record.log, lines), timeout=CONTROL_TIMEOUT_S)
        except Exception as exc:  # a lost node has no log to show
            return f"(the log on node {record.host} is out of reach: {type(exc).__name__})"

    def stop(self, cluster, grace_s=5.0):
        state = cluster.launcher_state
        if not state:
            return cluster.processes
        connect(state.get("address") or self.address)
        actors = {}
        for name in state.get("actors", []):
            try:
                actors[name] = self._actors.get(name) or ray.get_actor(name, namespace=state["namespace"])
            except ValueError:  # already gone (its driver died, or an earlier stop)
                pass
        calls = {name: actor.stop.remote(grace_s) for name, actor in actors.items()}
        codes: dict[tuple[str, int], int | None] = {}
        for name, call in calls.items():
            try:
                codes.update({(name, pid): code for pid, code in ray.get(call, timeout=grace_s + 15).items()})
            except Exception:  # a lost actor: its processes died with it (lifeline)
                pass
        for actor in actors.values():
            ray.kill(actor)
        try:
            remove_placement_group(get_placement_group(state["placement_group"]))
        except ValueError:  # never created, or already removed
            pass
        for record in cluster.processes:
            if record.exit_code is None and not record.exit_unknown:
                code = codes.get((record.actor, record.pid))
                record.exit_code = code
                record.exit_unknown = code is None  # its actor was lost, or its stop call failed
        self._actors.clear()
        self._exits.clear()
        cluster.save()
        return cluster.processes
