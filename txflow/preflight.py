"""Checks that run before any process starts: bad input fails here, cheaply."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import fsspec

from txflow.checkpoints import lease, storage
from txflow.checkpoints.markers import signing_key
from txflow.cluster import embedded_prefect, named
from txflow.config import NAMED_MODELS, TINY_MODEL, RunConfig, default_learning_rate, environ_without_secrets
from txflow.log import get_logger, redact, register_run_secrets, scrub
from txflow.reporting.report import Outcome
from txflow.training import custom, rl, sft
from txflow.training.datasets import REQUIRED_KEYS, bundled_dataset, load_jsonl
from txflow.training.rewards import load_reward
from txflow.training.tokenizer import load_tokenizer
from txflow.upstream import skyrl_tx
from txflow.upstream.named_models import NamedModelMissing
from txflow.upstream.tiny_model import resolve_base_model


class PreflightError(ValueError):
    """The run cannot start; the message says what to change."""


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).exists()


def check_base_model(cfg: RunConfig) -> str:
    """The local directory or hub id the engine will load (a named model converted into the cache first)."""
    if cfg.base_model not in (TINY_MODEL, *NAMED_MODELS) and _looks_like_path(cfg.base_model):
        path = Path(cfg.base_model).expanduser()
        if not path.is_dir():
            raise PreflightError(f"--base-model {cfg.base_model}: no such directory. Pass a local Hugging Face "
                                 f"model directory, a hub id such as Qwen/Qwen3-8B, or 'tiny'")
        if not (path / "config.json").exists():
            raise PreflightError(f"--base-model {cfg.base_model}: the directory has no config.json; "
                                 f"it is not a Hugging Face model directory")
        return str(path.absolute())
    try:
        return resolve_base_model(cfg.base_model)
    except NamedModelMissing as exc:
        raise PreflightError(f"--base-model {cfg.base_model}: {exc}") from None


def check_learning_rate(cfg: RunConfig) -> None:
    """A learning rate is set: given, or derived from the model (RunConfig.resolved)."""
    if cfg.learning_rate is None:
        why = default_learning_rate(cfg.mode, cfg.base_model)[1]
        raise PreflightError(f"--base-model {cfg.base_model}: no default learning rate ({why}); pass "
                             f"--learning-rate")


def context_length(model_path: str) -> int:
    config = Path(model_path) / "config.json"
    if config.exists():
        return int(json.loads(config.read_text()).get("max_position_embeddings", 1 << 30))
    return 1 << 30


def check_ray(cfg: RunConfig) -> None:
    """`--launcher ray` names a Ray cluster to join (txflow never starts one) and Ray is installed."""
    if not (cfg.ray.address or os.environ.get("RAY_ADDRESS")):
        raise PreflightError("--launcher ray needs an existing Ray cluster: pass --ray-address HOST:PORT or set "
                             "RAY_ADDRESS (txflow never starts a Ray cluster of its own)")
    if importlib.util.find_spec("ray") is None:
        raise PreflightError("--launcher ray needs Ray in this environment: pip install ray==2.60.0 "
                             "(see constraints.txt)")


def check_live_run(cfg: RunConfig) -> None:
    """No live run holds this run id (`--resume-from` included): two would wipe each other's staging and
    resume from each other's states. A root that cannot be read is `check_run_root`'s to report."""
    try:
        live = lease.holder(cfg.run_root, cfg.plain_storage_options())
    except Exception:  # any backend error: check_run_root says what is wrong with the root
        return
    if live is not None:
        raise PreflightError(lease.describe(live, cfg.run_root))


def check_run_root(cfg: RunConfig) -> None:
    """The root is reachable and writable, and this run id has not completed there before."""
    options = cfg.plain_storage_options()
    try:
        fs, root = fsspec.core.url_to_fs(cfg.run_root, **options)
    except (ValueError, ImportError) as exc:
        raise PreflightError(f"--checkpoints {cfg.checkpoints}: not a usable fsspec URL ({exc})") from None
    try:
        if fs.exists(f"{root}/report.json") and not cfg.resume_from:
            raise PreflightError(_earlier_run(cfg, _outcome(fs, f"{root}/report.json")))
        fs.makedirs(root, exist_ok=True)
        probe = f"{root}/.txflow-write-probe"
        fs.pipe_file(probe, b"ok")
        fs.rm_file(probe)
    except PreflightError:
        raise
    except Exception as exc:  # any backend error means the root cannot be used
        raise PreflightError(f"--checkpoints {cfg.checkpoints}: cannot write under {cfg.run_root} "
                             f"({type(exc).__name__}: {exc})") from None


def _earlier_status(cfg: RunConfig) -> str | None:
    """The status in the report.json of an earlier run with this run id, or None."""
    fs, root = fsspec.core.url_to_fs(cfg.run_root, **cfg.plain_storage_options())
    try:
        return _outcome(fs, f"{root}/report.json").status
    except FileNotFoundError:
        return None


def _outcome(fs, path: str) -> Outcome:
    """How the earlier run ended; a report.json that says no status still means the run id was used."""
    try:
        return Outcome.read(fs.cat_file(path))
    except ValueError as exc:
        return Outcome(status="unknown", error=f"its report.json is unreadable: {_first_line(exc)}")


def _earlier_run(cfg: RunConfig, report: Outcome) -> str:
    """What is true of the run that used this run id before: it passed, it failed (and how to go on), or
    its report cannot be read (the id is taken all the same)."""
    if report.status == "passed":
        return (f"Run {cfg.run_id} already completed under {cfg.run_root} (it passed); its checkpoints are kept. "
                f"Use another --run-id, or --resume-from {cfg.run_root} with more --steps to continue it")
    if report.status != "failed":
        return (f"Run {cfg.run_id} ran under {cfg.run_root} before ({report.error or 'status ' + report.status}); "
                f"its checkpoints are kept. Use another --run-id")
    error = (report.error or "its checks failed").splitlines()[0]
    return (f"Run {cfg.run_id} failed under {cfg.run_root} ({error}); its checkpoints are kept. Continue it from its "
            f"last committed state with --resume-from {cfg.run_root}, or use another --run-id")


# Run by the client's interpreter: its Python and Tinker SDK versions, and whether it finds a module client.
_CLIENT_ENV_PROBE = """
import importlib.util, json, sys
found = {"python": sys.version.split()[0]}
try:
    import tinker  # the client's own environment: txflow is not installed there
    found["tinker"] = getattr(tinker, "__version__", "unknown")
except Exception as exc:
    found["error"] = f"{type(exc).__name__}: {exc}"
if len(sys.argv) > 1:
    found["module"] = importlib.util.find_spec(sys.argv[1]) is not None
print(json.dumps(found))
"""


def check_client_python(cfg: RunConfig) -> str | None:
    """The interpreter `--client-python` names, as an absolute path, once it runs and imports
    `tinker` (and finds the client, if that is a module); None without `--client-python`."""
    given = cfg.custom.client_python
    if not given:
        return None
    if os.sep in given or given.startswith("~"):
        # Not resolved: a venv's bin/python is a symlink whose target is outside the venv.
        python = str(Path(given).expanduser().absolute())
        if not Path(python).is_file():
            raise PreflightError(f"--client-python {given}: no such file. Pass the Python interpreter of the "
                                 f"environment your client runs in, e.g. /path/to/venv/bin/python")
        if not os.access(python, os.X_OK):
            raise PreflightError(f"--client-python {given}: the file is not executable. Pass the environment's "
                                 f"bin/python, or make it executable")
    else:
        python = shutil.which(given)
        if python is None:
            raise PreflightError(f"--client-python {given}: no such command on PATH. Pass the path of the Python "
                                 f"interpreter of your client's environment, e.g. /path/to/venv/bin/python")
    is_module = custom.is_module(cfg.custom.client)
    try:
        probe = subprocess.run([python, "-c", _CLIENT_ENV_PROBE, *([cfg.custom.client] if is_module else [])],
                               capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                               env=environ_without_secrets())
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PreflightError(f"--client-python {given}: does not run ({exc})") from None
    try:
        found = json.loads(probe.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise PreflightError(f"--client-python {given}: does not run as a Python interpreter (exit code "
                             f"{probe.returncode}: {probe.stderr.strip()[-500:]})") from None
    if "error" in found:
        raise PreflightError(f"--client-python {given}: cannot import tinker ({found['error']}). Install the "
                             f"Tinker SDK into that environment: {python} -m pip install tinker")
    if is_module and not found.get("module"):
        raise PreflightError(f"--client {cfg.custom.client}: not a .py file, and {given} finds no module of that name. "
                             f"Pass the client's path, or install it into that environment")
    get_logger().info(f"client environment: {python} (Python {found['python']}, tinker {found['tinker']})")
    return python


@dataclass(frozen=True)
class Checked:
    """What pre-flight found a run needs: the base model the engine loads (resolved here, once, for the whole
    run: a named model is converted into the cache on its first use) and the prepared data of its mode."""

    base_model_path: str
    data: sft.SFTData | rl.RLData | custom.CustomData


def prepare(cfg: RunConfig) -> Checked:
    """Validate everything a run needs, before any process starts. Bad input raises PreflightError with a
    sentence that says what to change."""
    register_run_secrets(cfg)  # a message may quote a URL or a backend's error: no credential may show
    try:
        return _prepare(cfg)
    except PreflightError as exc:
        raise PreflightError(scrub(str(exc))) from None


def check_approval(cfg: RunConfig) -> None:
    """An approval needs a Prefect server a person can open: not the embedded one of `txflow run`, which
    lives and dies with the run (nobody could approve on it)."""
    if cfg.export.approve and (not os.environ.get("PREFECT_API_URL") or embedded_prefect.is_embedded()):
        raise PreflightError("--approve waits for a person on a Prefect server, and this run has none (txflow run "
                             "starts a private one): run it as a deployment (prefect deployment run train/sft "
                             "--param ...), or drop --approve")


def check_database(cfg: RunConfig) -> None:
    """A configured database answers and takes the credentials (SQLite in the state directory needs no
    check): a bad URL, host or password fails here, not after the cluster started."""
    if cfg.database_url is None:
        return
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    given = cfg.database_url.get_secret_value()
    try:
        url = make_url(given)
        engine = create_engine(url, connect_args={"connect_timeout": 10} if url.get_backend_name() == "postgresql"
                               else {})
    except Exception as exc:  # unparseable, or a driver that is not installed
        raise PreflightError(f"--database-url {redact(given)}: not a usable database URL "
                             f"({_first_line(exc)})") from None
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as exc:  # refused, unreachable, wrong password: the driver says which
        raise PreflightError(f"--database-url {redact(given)}: cannot connect ({_first_line(exc)})") from None
    finally:
        engine.dispose()


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("\n")[0].split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _prepare(cfg: RunConfig) -> Checked:
    check_live_run(cfg)
    check_approval(cfg)
    try:
        skyrl_tx.check_upstream_version()
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    if cfg.launcher == "ray":
        check_ray(cfg)
    check_database(cfg)
    model_path = check_base_model(cfg)
    if cfg.cluster:
        try:
            named.check(cfg, model_path)
        except named.AttachFailed as exc:
            raise PreflightError(str(exc)) from None
    check_learning_rate(cfg)
    tokenizer = load_tokenizer(model_path)
    max_len = context_length(model_path)
    try:
        signing_key()  # a key too short, or a Secret block that cannot be read, stops the run here
        if cfg.mode == "custom":
            command = custom.client_command(cfg.custom.client, check_client_python(cfg))
            probe = sft.prepare(load_jsonl(bundled_dataset("sft"), REQUIRED_KEYS["sft"]), tokenizer, max_len, "")
            data = custom.CustomData(command=command, probe=probe.eval)
        else:
            url = cfg.dataset or bundled_dataset(cfg.mode, cfg.base_model)
            rows = load_jsonl(url, REQUIRED_KEYS[cfg.mode], cfg.plain_storage_options(), messages=cfg.mode == "sft")
            if cfg.mode == "sft":
                eval_rows = (load_jsonl(cfg.eval_dataset, REQUIRED_KEYS["sft"], cfg.plain_storage_options(),
                                        messages=True) if cfg.eval_dataset else None)
                data = sft.prepare(rows, tokenizer, max_len, url, eval_rows, cfg.eval_dataset or "")
            else:
                data = rl.prepare(rows, tokenizer, max_len, cfg.rl.max_tokens, url, load_reward(cfg.rl.reward),
                                  cfg.rl.reward)
        if cfg.resume_from:
            _, step = storage.resolve_resume_from(cfg)
            # A failed run continued from its own root at its last step redoes what failed after training;
            # any other checkpoint at or past --steps would train nothing.
            redo = cfg.resume_from.rstrip("/") == cfg.run_root.rstrip("/") and _earlier_status(cfg) == "failed"
            if step >= cfg.steps and cfg.mode != "custom" and not (redo and step == cfg.steps):
                raise ValueError(f"--resume-from {cfg.resume_from} is at step {step}; --steps {cfg.steps} leaves "
                                 f"nothing to train: pass --steps above {step}")
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    # Last: the only check that writes (it creates the run root).
    check_run_root(cfg)
    return Checked(base_model_path=model_path, data=data)
