"""Helpers shared by the tests."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from txflow.processes.procfs import is_alive, proc_stats, start_time

# The Prefect CLI of the interpreter running the tests (the project venv).
PREFECT = str(Path(sys.executable).parent / "prefect")

# Secrets a run is given in tests; none may appear in any output of the run.
PASSWORD_MARKER = "pw-MARKER-7f3c91"
API_KEY_MARKER = "tml-key-MARKER-0c55e1"

# A user's own process: transformers + peft load an exported adapter and continue each prompt greedily.
# Arguments: base model, adapter directory, prompts as JSON, tokens per prompt. Prints the greedy continuation
# of each prompt as JSON, as `generate` gives it: it stops after the end-of-sequence token.
LOAD_PEFT_AND_GREEDY = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sys.argv[1]), sys.argv[2])
n, out = int(sys.argv[4]), []
for prompt in json.loads(sys.argv[3]):
    ids = torch.tensor([prompt])
    generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               do_sample=False, pad_token_id=0)
    out.append(generated[0, len(prompt):].tolist())
print(json.dumps({"eos": model.config.eos_token_id, "tokens": out}))
"""


def until_eos(sequences: list[list[int]], eos: int) -> list[list[int]]:
    """Each sequence up to and with its first `eos`: what `generate` gives for a sampler's fixed-length
    greedy tokens (the sampler goes on after the end of sequence, `generate` stops)."""
    return [s[: s.index(eos) + 1] if eos in s else s for s in sequences]


def cluster_pids(state_dir: Path) -> list[tuple[int, int | None]]:
    """(pid, start_time) of every process recorded in cluster.json."""
    data = json.loads((Path(state_dir) / "cluster.json").read_text())
    return [(p["pid"], p["start_time"]) for p in data["processes"]]


def alive_pids(state_dir: Path) -> list[int]:
    return [pid for pid, started in cluster_pids(state_dir) if is_alive(pid, started)]


def descendants(pid: int) -> list[tuple[int, int | None]]:
    """(pid, start time) of every live descendant of `pid`, whatever its session."""
    children: dict[int, list[int]] = {}
    for child, fields in proc_stats():
        children.setdefault(int(fields[1]), []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append((child, start_time(child)))
            todo.append(child)
    return found


def new_prefect_home(path: Path, prefect_db: Path) -> Path:
    """`path` as a Prefect home holding a copy of the migrated template database (conftest's prefect_db)."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(prefect_db, path / "prefect.db")
    return path


def txflow_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "txflow.cli", *args]


def run_txflow(args: list[str], env: dict, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(txflow_cmd(*args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


class MotoServer:
    """A real S3 API (moto_server) on 127.0.0.1, in its own process group."""

    def __init__(self, log_path: Path):
        import os
        import time

        from txflow.processes.groups import spawn
        from txflow.processes.ports import free_port, port_open

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = spawn([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
                          log_path, env=dict(os.environ))
        deadline = time.monotonic() + 30
        while not port_open("127.0.0.1", self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto_server did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)

    def env(self, secret_key: str) -> dict[str, str]:
        """AWS_* variables that point boto3, s3fs and cloudpathlib at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "txflow-test",
                "AWS_SECRET_ACCESS_KEY": secret_key, "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        from txflow.processes.groups import stop_groups

        stop_groups([self.proc.pid], grace_s=3.0)
        self.proc.wait(timeout=10)


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target port; `stop()` makes the server behind it vanish
    for clients while the real server (and its state) lives on."""

    def __init__(self, target_port: int):
        import socket
        import threading

        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.connections: list = []
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import socket

        while not self.stopped.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.connections += [client, upstream]
            self._serve(client, upstream)

    def _serve(self, client, upstream):
        """Pipe both ways, each in its own thread."""
        import threading

        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.close()
                except OSError:
                    pass

    def stop(self) -> None:
        self.stopped.set()
        self.listener.close()
        import socket

        for sock in self.connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            except OSError:
                pass


class HoldingProxy(TcpProxy):
    """A TcpProxy that holds, unsent, the first request whose request line contains `hold_on` (and
    everything after it on that connection): `held` is set, and the client waits as on a server that
    stopped answering, until it is killed or `stop()` cuts the connection."""

    def __init__(self, target_port: int, hold_on: bytes):
        import threading

        self.hold_on = hold_on
        self.held = threading.Event()
        super().__init__(target_port)

    def _serve(self, client, upstream):
        import threading

        threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()
        threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    def _requests(self, src, dst):
        try:
            while data := src.recv(65536):
                if self.hold_on in data.split(b"\r\n", 1)[0]:
                    self.held.set()
                    return  # never sent: the connection stays open and silent
                dst.sendall(data)
        except OSError:
            pass


def private_mounts_work() -> bool:
    """Whether this machine lets us give a process its own mount namespace (root on Linux)."""
    try:
        return subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                              capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def fresh_root(kind: str, local: Path) -> Iterator[str]:
    """A storage root that does not exist yet, for a parametrized fixture: `local` for "local", else a
    unique memory:// URL, removed afterwards."""
    if kind == "local":
        yield str(local)
        return
    import fsspec

    url = f"memory://txflow-test-{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def listening_addresses(port: int) -> list[str]:
    """The local addresses on which something listens on TCP `port` (IPv4 as a.b.c.d, IPv6 as hex), from /proc."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(".".join(str(b) for b in reversed(bytes.fromhex(address))) if len(address) == 8
                             else address)
    return found


# A bucket on the tests' moto_server (the `moto` fixture of conftest), and its secret key: a marker that
# must never show in any output.
BUCKET = "txflow-ckpt"
S3_SECRET_MARKER = "s3-secret-MARKER-42aa"


def bucket_keys(prefix: str) -> dict[str, int]:
    """{key: size} of every object under `prefix` in BUCKET (AWS_* point boto3 at moto)."""
    import boto3

    s3 = boto3.client("s3")
    keys = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return keys


def lease_race(run_root: str, contenders: int = 8) -> list[str]:
    """`contenders` runs taking over one dead lease under `run_root` at the same moment (the lease expired 100 s
    ago, by another host's clock): the run ids that got it. Each watches it unchanged for 0.5 s and judges it
    dead 0.1 s after reading it, so all of them read it before any writes (call it with `lease.stale` slowed,
    as the tests do)."""
    import threading
    import time

    import fsspec

    from txflow.checkpoints import lease

    fs, root = fsspec.core.url_to_fs(run_root)
    fs.makedirs(root, exist_ok=True)
    path = f"{root.rstrip('/')}/{lease.LEASE}"
    now = time.time()
    fs.pipe_file(path, json.dumps({"run_id": "dead", "host": "another-host", "pid": 1, "renewed_at": now - 700,
                                   "expires_at": now - 100}).encode())
    start, won, errors = threading.Barrier(contenders), [], []

    def contender(i: int) -> None:
        start.wait()
        try:
            lease._acquire(fs, path, run_root, f"run{i}", f"token{i}", ttl_s=0.5, poll_s=0.05)  # watched 0.5 s
            won.append(f"run{i}")
        except lease.LeaseHeld:
            pass
        except Exception as exc:  # a contender must either get the lease or be told who holds it
            errors.append(exc)

    threads = [threading.Thread(target=contender, args=(i,)) for i in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return won


def taken_over_while_held(run_root: str, renew: bool = True) -> tuple[dict, list[str]]:
    """A run holds `run_root`'s lease, renewing every 0.1 s (or, without `renew`, not before it ends); another
    run's lease is written over it (as a takeover by a run that found it dead would). The lease after the
    holder's block ended, and what the holder logged."""
    import logging
    import time

    import fsspec

    from txflow.checkpoints import lease

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("txflow")
    logger.addHandler(handler)
    try:
        with lease.held(run_root, "r", renew_s=0.1 if renew else 600) as path:
            fs, _ = fsspec.core.url_to_fs(run_root)
            now = time.time()
            fs.pipe_file(path, json.dumps({"run_id": "other", "host": "another-host", "pid": 1, "token": "t",
                                           "renewed_at": now, "expires_at": now + 600}).encode())
            time.sleep(0.5 if renew else 0)  # the holder's renewals; or it ends, releasing its lease
    finally:
        logger.removeHandler(handler)
    return lease.holder(run_root), messages
