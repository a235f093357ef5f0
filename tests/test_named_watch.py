"""What an attached run's monitor names when a named cluster dies (txflow.cluster.named._Watch), with a fake
launcher: the death the holder saw, not the processes its stop then ended. The real thing, on Ray:
tests/test_ray_e2e.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from txflow.cluster import named
from txflow.cluster.launcher import LostProcess
from txflow.cluster.monitor import RankMonitor
from txflow.cluster.records import Cluster, ProcessRecord
from txflow.processes import procfs


class FakeLauncher:
    """Exit codes by rank; a rank mapped to LostProcess is out of reach (its actor killed)."""

    name = "fake"

    def __init__(self, codes: dict):
        self.codes = codes

    def exit_code(self, record):
        code = self.codes.get(record.rank)
        if isinstance(code, type) and issubclass(code, Exception):
            raise code(f"its actor for rank {record.rank} is gone")
        return code

    def tail(self, record, lines=30):
        return ""


@pytest.fixture
def cluster_of(tmp_path, monkeypatch):
    monkeypatch.setenv(named.CLUSTERS_DIR_ENV, str(tmp_path))

    def make(holder_pid: int, failure: dict | None) -> tuple[named.Serves, Cluster]:
        (tmp_path / "warm").mkdir()
        serves = named.Serves(name="warm", launcher="ray", base_model="tiny", base_model_path="x", max_lora_rank=32,
                              lora_adapters=8, processes=2, base_url="http://127.0.0.1:1", sqlite=True,
                              holder_pid=holder_pid, holder_start_time=procfs.start_time(holder_pid), state="up")
        named._save_serves(serves)
        if failure is not None:  # what the holder writes once it sees a death, before it stops the rest
            named._save_serves(serves.model_copy(update={"failure": failure}))
        records = [ProcessRecord(role="api", rank=None, pid=1, host="h", log="api.log"),
                   ProcessRecord(role="coordinator", rank=0, pid=2, host="h", log="rank0.log"),
                   ProcessRecord(role="worker", rank=1, pid=3, host="h", log="rank1.log")]
        cluster = Cluster(run_id="warm", launcher="ray", state_dir=str(tmp_path / "warm"), host="h", api_port=1,
                          coordinator_port=None, num_processes=2, base_model_path="x", checkpoints_base="y",
                          processes=records)
        return serves, cluster

    return make


def first_failure(serves, cluster, codes):
    monitor = RankMonitor(cluster, named._Watch(serves, FakeLauncher(codes)))
    monitor.poll()
    return monitor.first_failure()


RANK1_KILLED = {"rank": 1, "role": "worker", "exit_code": -signal.SIGKILL,
                "message": "rank 1 (worker), pid 3, was killed by signal 9."}


def test_the_death_the_holder_saw_is_named_not_the_ranks_its_stop_ended(cluster_of):
    serves, cluster = cluster_of(os.getpid(), RANK1_KILLED)
    # The holder's stop ran: rank 0 and the API got its SIGTERM, rank 1's actor is gone already.
    failure = first_failure(serves, cluster, {None: -signal.SIGTERM, 0: -signal.SIGTERM, 1: LostProcess})
    assert (failure.rank, failure.exit_code) == (1, -signal.SIGKILL)


def test_once_the_holder_is_gone_too_its_cause_is_still_named(cluster_of):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    serves, cluster = cluster_of(gone.pid, RANK1_KILLED)
    assert first_failure(serves, cluster, {}).rank == 1


def test_without_a_cause_from_the_holder_deaths_are_named_as_found(cluster_of):
    serves, cluster = cluster_of(os.getpid(), None)
    failure = first_failure(serves, cluster, {None: None, 0: -signal.SIGTERM, 1: None})
    assert (failure.rank, failure.exit_code) == (0, -signal.SIGTERM)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    serves = serves.model_copy(update={"holder_pid": gone.pid, "holder_start_time": None})
    failure = first_failure(serves, cluster, {})
    assert failure.rank == 0 and f"holder of cluster warm (pid {gone.pid}) is gone" in failure.message


def test_the_holder_releases_only_runs_whose_process_it_sees_gone(tmp_path, monkeypatch):
    """`reap` (the holder, every 2 s): a run key whose process on this machine is gone is released; one whose
    process still runs, one attached from another machine (only that machine can tell), a key given out (it
    expires) are left as they are, and nothing of the cluster's is asked about them. The release itself, on the
    real API: tests/test_shared_cluster_e2e.py."""
    import json
    import socket
    from types import SimpleNamespace

    from pydantic import SecretStr

    monkeypatch.setenv(named.CLUSTERS_DIR_ENV, str(tmp_path))
    (tmp_path / "c").mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = {"pid": os.getpid(), "start": procfs.start_time(os.getpid())}
    keys = {"running": {"owner": "running", "kind": "run", **me, "host": socket.gethostname()},
            "elsewhere": {"owner": "elsewhere", "kind": "run", "pid": dead.pid, "start": 1, "host": "another-node"},
            "notebook": {"owner": "alice", "kind": "key", "expires": 1e12},
            "gone": {"owner": "gone", "kind": "run", "pid": dead.pid, "start": 1, "host": socket.gethostname()}}
    (tmp_path / "c" / named.RUN_KEYS).write_text(json.dumps(keys))
    asked = []

    def get(url, params, headers, timeout):  # the API's answer for the one run it should ask about
        asked.append(params["owner"])
        return SimpleNamespace(raise_for_status=lambda: None, json=lambda: {"sessions": [], "models": []})

    monkeypatch.setattr(named.httpx, "get", get)
    monkeypatch.setattr(named, "load_serves", lambda name: None)
    monkeypatch.setattr(named, "database_url", lambda serves, cfg=None: f"sqlite:///{tmp_path / 'tinker.db'}")
    handle = SimpleNamespace(cluster=SimpleNamespace(base_url="http://127.0.0.1:1", api_key=SecretStr("k"),
                                                     checkpoints_base=str(tmp_path / "staging")))
    assert named.reap("c", handle) == ["gone"] and asked == ["gone"]
    assert set(json.loads((tmp_path / "c" / named.RUN_KEYS).read_text())) == {"running", "elsewhere", "notebook"}
    assert named.reap("c", handle) == [] and asked == ["gone"]


def test_a_run_attaching_again_leaves_its_ids_earlier_keys_to_the_holder_which_releases_the_gone_one(tmp_path,
                                                                                                    monkeypatch):
    """A run id attaching again after its run died without its teardown (or after this process's earlier
    attach) registers its own key beside the earlier one, never in its place: only the holder may ask what
    another key holds, and its `reap` unloads that and revokes the key once its process is gone. A live run of
    the same id on this machine is refused."""
    import json
    import socket
    from types import SimpleNamespace

    from pydantic import SecretStr

    monkeypatch.setenv(named.CLUSTERS_DIR_ENV, str(tmp_path))
    (tmp_path / "c").mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = socket.gethostname()
    me = {"pid": os.getpid(), "start": procfs.start_time(os.getpid()), "host": here}
    keys = {"gone": {"owner": "again", "kind": "run", "pid": dead.pid, "start": 1, "host": here},
            "earlier": {"owner": "again", "kind": "run", **me}}
    path = tmp_path / "c" / named.RUN_KEYS
    path.write_text(json.dumps(keys))
    cfg = SimpleNamespace(cluster="c", run_id="again")
    named._register_run_key(cfg, "tml-new")
    now = json.loads(path.read_text())
    assert set(now) == {"gone", "earlier", named.key_digest("tml-new")}
    new = now[named.key_digest("tml-new")]
    assert new["owner"] == "again" and new["pid"] == os.getpid()

    asked = []
    monkeypatch.setattr(named.httpx, "get", lambda url, params, headers, timeout: asked.append(params["owner"]) or
                        SimpleNamespace(raise_for_status=lambda: None, json=lambda: {"sessions": [], "models": []}))
    monkeypatch.setattr(named, "load_serves", lambda name: None)
    monkeypatch.setattr(named, "database_url", lambda serves, cfg=None: f"sqlite:///{tmp_path / 'tinker.db'}")
    handle = SimpleNamespace(cluster=SimpleNamespace(base_url="http://127.0.0.1:1", api_key=SecretStr("k"),
                                                     checkpoints_base=str(tmp_path / "staging")))
    assert named.reap("c", handle) == ["again"] and asked == ["gone"]
    assert set(json.loads(path.read_text())) == {"earlier", named.key_digest("tml-new")}

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path.write_text(json.dumps({"live": {"owner": "again", "kind": "run", "pid": live.pid,
                                             "start": procfs.start_time(live.pid), "host": here}}))
        with pytest.raises(named.AttachFailed, match=rf"run id again is attached to cluster c already \(pid "
                                                      rf"{live.pid}\); give this run another --run-id"):
            named._register_run_key(cfg, "tml-twin")
        assert set(json.loads(path.read_text())) == {"live"}
    finally:
        live.kill()
        live.wait()


def test_a_model_whose_creation_the_engine_refused_holds_no_slot(tmp_path):
    """The engine refuses a model when every slot is held; its row stays, with a failed creation future. Counted, it
    would make `cluster status` print fewer free slots than there are (below zero), and a run attaching wait for a
    slot in vain."""
    from sqlmodel import Session, SQLModel, create_engine
    from tx.tinker import db_models, types

    db_url = f"sqlite:///{tmp_path / 'tinker.db'}"
    engine = create_engine(db_url)
    SQLModel.metadata.create_all(engine)
    rows = {"held": db_models.RequestStatus.COMPLETED, "refused": db_models.RequestStatus.FAILED,
            "creating": db_models.RequestStatus.PENDING}
    with Session(engine) as session:
        session.add(db_models.SessionDB(session_id="s", sdk_version="0.38.0", status="active"))
        for request_id, (model_id, status) in enumerate(rows.items(), start=1):
            session.add(db_models.FutureDB(request_id=request_id, request_type=types.RequestType.CREATE_MODEL,
                                           model_id=model_id, request_data={}, status=status))
            session.add(db_models.ModelDB(model_id=model_id, base_model="tiny", lora_config={}, status="created",
                                          request_id=request_id, session_id="s"))
        session.commit()
    engine.dispose()
    assert sorted(named.loaded_models(db_url)) == ["creating", "held"]
    serves = named.Serves.model_construct(lora_adapters=4)
    assert named.free_slots(serves, db_url) == 1
