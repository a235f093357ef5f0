"""Shared fixtures: an isolated environment for `txflow` subprocesses, and a
reaper that stops every cluster process a test started, also when it fails."""

from __future__ import annotations

import ast
import functools
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pgserver
import pytest

from tests.helpers import BUCKET, PASSWORD_MARKER, PREFECT, S3_SECRET_MARKER, MotoServer, new_prefect_home
from txflow.cluster.launchers import stop_cluster

REPO = Path(__file__).resolve().parents[1]



def _programs_kept_in_the_machines_cache() -> None:
    """This process's own JAX programs (the engine's changes tested in process, on the tiny model and on SmolLM2) go
    to the machine's compilation cache, as a cluster's ranks' do (`txflow.cluster.startup.child_env`): a later
    suite on the machine loads them instead of compiling them again (docs/development.md). Every
    program, however quick to compile: most of the tests' are small, and JAX keeps only those of 1 s and more by
    default. An explicit JAX_COMPILATION_CACHE_DIR (or "" to switch it off) wins, as for a cluster; a test that needs
    a cache of its own sets one (tests/test_compile_log.py)."""
    import jax

    from txflow.upstream.tiny_model import cache_dir

    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax-compilation"))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


_programs_kept_in_the_machines_cache()

# Runs track nothing in MLflow unless a test asks (tests/test_tracking_e2e.py): a store is a record of the user's
# runs, and a new one costs ~6 s of migrations in every working directory a test runs in.
os.environ.setdefault("TXFLOW_TRACKING_URI", "off")


@pytest.fixture(scope="session")
def prefect_db(tmp_path_factory) -> Path:
    """An empty Prefect database with every migration applied, made once per session.

    Each test gets its own Prefect home; starting from a copy of this file spares every
    run the migrations of a new database (about 12 s of a 25 s start on this machine).
    """
    home = tmp_path_factory.mktemp("prefect-template")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    subprocess.run([PREFECT, "server", "database", "upgrade", "-y"], env=env, check=True, capture_output=True,
                   timeout=300)
    return home / "prefect.db"


@pytest.fixture
def txflow_env(tmp_path, prefect_db) -> dict[str, str]:
    """Environment for a `txflow` subprocess: its own Prefect home (embedded API, SQLite)."""
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    env.update(
        PREFECT_HOME=str(new_prefect_home(tmp_path / "prefect-home", prefect_db)),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        TINKER_TELEMETRY="0",
        PYTHONUNBUFFERED="1",
    )
    return env


class Reaper:
    """Remembers run state directories; stops whatever is still alive at the end."""

    def __init__(self) -> None:
        self.state_dirs: list[Path] = []

    def watch(self, state_dir: Path) -> Path:
        self.state_dirs.append(Path(state_dir))
        return Path(state_dir)

    def stop_all(self) -> None:
        for state_dir in self.state_dirs:
            stop_cluster(state_dir, grace_s=1.0)


@pytest.fixture
def reaper():
    reaper = Reaper()
    yield reaper
    reaper.stop_all()


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL (unix socket only, no TCP) with a user whose password is the marker.

    Yields a function that creates a fresh database and returns its URL: one per run,
    since a SkyRL-tx engine serves every request in its database.
    """
    # Not under pytest's 0700 temp root: the server runs as its own system user.
    data_dir = Path(tempfile.mkdtemp(prefix="txflow-pg-"))
    server = pgserver.get_server(data_dir, cleanup_mode="stop")

    def new_database(name: str) -> str:
        server.psql(f"CREATE DATABASE {name} OWNER txflow;")
        return f"postgresql://txflow:{PASSWORD_MARKER}@/{name}?host={data_dir}"

    try:
        server.psql("SET password_encryption = 'scram-sha-256';"
                    f"CREATE USER txflow WITH PASSWORD '{PASSWORD_MARKER}';")
        # pgserver's initdb trusts every local connection; the test role must prove its password, or a
        # mangled or masked URL handed to the engine would still connect.
        hba = data_dir / "pg_hba.conf"
        hba.write_text("local all txflow scram-sha-256\n" + hba.read_text())
        server.psql("SELECT pg_reload_conf();")
        yield new_database
    finally:
        server.cleanup()
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    """A real S3 API on 127.0.0.1 with BUCKET in it, for the tests of one module: (server, AWS_* env)."""
    import boto3

    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        env = server.env(S3_SECRET_MARKER)
        boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id="txflow-test",
                     aws_secret_access_key=S3_SECRET_MARKER, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield server, env
    finally:
        server.stop()


@pytest.fixture
def s3_env(moto, txflow_env, monkeypatch):
    """AWS_* for this process (s3fs in the test) and for `txflow` subprocesses."""
    import s3fs

    _, env = moto
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # fsspec caches filesystems by their arguments, not by the environment they read: an S3 filesystem made
    # for another module's server (stopped since) would be handed out again in this process.
    s3fs.S3FileSystem.clear_instance_cache()
    return txflow_env | env



# `make test` runs every test but the `timed` ones on two pytest-xdist workers: most of an end-to-end
# test's time is one process importing, compiling or waiting, so two at once fill the machine's two cores (measured:
# two 1-process SFT runs at once took 71 s, one alone 57 s). What the schedule must know, each test module says
# itself in its `pytestmark` (the markers are registered in pyproject.toml):
#   together  its tests share a module-scoped fixture (one run, one server, one Ray cluster, one S3 server; some
#             rely on the order of the module): they go to one worker, so it is set up once. Every other test is
#             scheduled on its own. A module with such a fixture and without the mark fails collection.
#   heavy(n)  a module of long end-to-end tests: the end-to-end tests run first, the heavy modules first of them,
#             heavy(1) first, so that neither worker is left with a long test while the other has finished (the
#             ranks from a full run's times).
#   timed     unit tests that assert on wall-clock times (sub-second margins some of them): `make test` runs them
#             first and alone, so that nothing else shares the CPU with them.


@functools.cache
def declared_marks(path: Path) -> frozenset[str]:
    """The marks a test module declares in its `pytestmark`, read from its source: xdist's controller
    schedules from node ids alone and never imports the tests."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                 for t in node.targets):
            return frozenset(n.attr for n in ast.walk(node.value)
                             if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "pytest.mark")
    return frozenset()


def pytest_collection_modifyitems(config, items):
    # A module fixture outside a `together` module would be set up on both workers, once each: say so at once
    # (read from the source, as the scheduler reads it).
    shared = {item.path for item in items
              if any(d.scope in ("module", "package") for defs in item._fixtureinfo.name2fixturedefs.values()
                     for d in defs)}
    unmarked = sorted(path.name for path in shared if "together" not in declared_marks(path))
    if unmarked:
        raise pytest.UsageError(f"{', '.join(unmarked)}: their tests share a module-scoped fixture; add "
                                "`pytestmark = [pytest.mark.together]` (tests/conftest.py)")

    def rank(item) -> tuple[bool, float]:
        heavy = item.get_closest_marker("heavy")
        return "e2e" not in item.keywords, heavy.args[0] if heavy else math.inf

    items.sort(key=rank)  # stable: a module keeps its own order


def pytest_xdist_make_scheduler(config, log):
    # xdist's own `loadgroup` marks groups by rewriting the node id, which pytest 9.2 no longer allows.
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixturesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if "together" in declared_marks(config.rootpath / module) else nodeid

    return SharedFixturesTogether(config, log)


pytest_plugins = ["tests.time_limits"]  # every test well within its time limit
