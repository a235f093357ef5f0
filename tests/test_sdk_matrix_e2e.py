"""Clients of every current Tinker SDK run unchanged against the default cluster (2 processes).

Each SDK version gets its own small environment (tests/sdk_envs.py) and a client written
for that SDK's public API; `txflow run custom --client-python` runs it there. The client
trains with forward_backward and optim_step in flight together, saves its state, restores
it into a new training client and runs a forward pass, and samples greedily from an
ephemeral sampler and from saved sampler weights. The run then discovers and verifies every
checkpoint the client saved.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import safetensors.numpy

from tasks.launch_workers import launch_workers
from tasks.provision_coordinator import provision_coordinator
from tasks.teardown import teardown
from tests.helpers import alive_pids, run_txflow
from tests.sdk_envs import SDK_VERSIONS, TORCH, sdk_env, torch_layer
from txflow.cluster.launchers.local import LocalLauncher
from txflow.config import RunConfig
from txflow.processes import groups, lifeline
from txflow.processes.ports import LISTEN_FD_ENV, free_port, port_open
from txflow.training.custom import client_env
from txflow.upstream.skyrl_tx.tinker_compat import SKIP_ENV
from txflow.upstream.tiny_model import resolve_base_model
from txflow.upstream.wake import ENV as WAKE_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.heavy(6)]

CLIENTS = Path(__file__).parent / "clients"
# What a client sees does not depend on how many JAX processes serve it (test_sft_e2e, test_fault_e2e and
# test_s3_e2e prove 2); one process halves the CPU these runs take on a 2-core machine.
ONE_PROCESS = ("--processes", "1")
# 0.13 and 0.25 have the same public API for what the client does; 0.38 returns futures of clients.
CLIENT_FOR = {"0.13.1": "sdk_client_0_13.py", "0.25.0": "sdk_client_0_13.py", "0.38.0": "sdk_client_0_38.py"}

# tinker-cookbook 0.6.1 in the 0.38 environment (torch comes from the shared layer, tests/sdk_envs.py).
# Its dependency tml-renderers>=0.4.1 is not on the package index (0.2.1 is the newest there); it
# is imported lazily and only for models served through it, not for a Hugging Face tokenizer with
# the `role_colon` renderer, so every other dependency is installed and the cookbook without deps.
COOKBOOK_STEPS = (
    ("aiohttp", "anyio", "blobfile", "chz", "cloudpickle", "datasets", "pillow", "pyrage", "termcolor",
     "tiktoken"),
    ("--no-deps", "tinker-cookbook==0.6.1"),
    ("sympy", "pylatexenc", "math-verify"),  # its math-rl extra, which the RL recipe imports
)
COOKBOOK_ENV = "tinker-0.38.0-cookbook-0.6.1-math-rl"
CONVERSATIONS = [("English: one\nFrench:", " un"), ("English: two\nFrench:", " deux"),
                 ("English: three\nFrench:", " trois"), ("English: four\nFrench:", " quatre")]


def client_lines(state: Path) -> list[str]:
    return (state / "logs" / "client.log").read_text().splitlines()


def assert_every_saved_checkpoint_verified(report: dict) -> dict[str, list[dict]]:
    """Every checkpoint the client saved was found, committed, restored and checked; by kind."""
    saved: dict[str, list[dict]] = {}
    for checkpoint in report["checkpoints"]["all"]:
        saved.setdefault(checkpoint["kind"], []).append(checkpoint)
    assert set(saved) == {"state", "sampler"}, saved
    checks = report["restore"]["checks"]
    assert sorted(c["tinker_path"] for c in checks) == sorted(c["tinker_path"] for c in report["checkpoints"]["all"])
    assert all(c["passed"] for c in checks) and report["restore"]["passed"], checks
    artifacts = {a["url"]: a for a in report["artifacts"]}
    for checkpoint in report["checkpoints"]["all"]:
        assert artifacts[checkpoint["url"]]["complete"] and artifacts[checkpoint["url"]]["committed"], checkpoint
    return saved


@pytest.mark.parametrize("version", SDK_VERSIONS)
def test_a_client_of_each_sdk_runs_unchanged_in_its_own_environment(version, tmp_path, txflow_env, reaper):
    python = sdk_env(version) / "bin" / "python"
    # torch (forward_backward_custom needs it) is the shared layer's build, not one the SDK's install pulled.
    where = subprocess.run([str(python), "-c", "import torch; print(torch.__file__, torch.__version__)"],
                           capture_output=True, text=True, timeout=120)
    assert where.stdout.split() == [str(torch_layer() / "torch" / "__init__.py"),
                                    TORCH.split("==")[1] + "+cpu"], where.stderr[-2000:]
    state = reaper.watch(tmp_path / "state")
    result = run_txflow(["run", "custom", "--base-model", "tiny", "--run-id", "sdk-" + version.replace(".", "-"),
                         "--state-dir", str(state),
                         "--checkpoints", str(tmp_path / "ckpt"), "--client", str(CLIENTS / CLIENT_FOR[version]),
                         "--client-python", str(python), *ONE_PROCESS,
                         "--client-arg=--base-url", "--client-arg={base_url}",
                         "--client-arg=--model-name", "--client-arg={base_model}", "--json"], txflow_env, tmp_path)
    log = "\n".join(client_lines(state)) if (state / "logs" / "client.log").exists() else ""
    assert result.returncode == 0, result.stderr[-3000:] + "\n--- client.log ---\n" + log[-3000:]
    report = json.loads(result.stdout)
    assert report["status"] == "passed" and report["mode"] == "custom"

    # The client ran under the interpreter it was given, with that environment's SDK.
    assert f"client environment: {python} (Python 3." in result.stderr and f"tinker {version})" in result.stderr
    lines = client_lines(state)
    assert lines[0] == f"tinker {version}"
    assert lines[-1] == "done"
    # The handshake turned pyqwest off (0.13 has none): its tokio threads can abort a client at exit.
    assert lines[-2] == "http transport httpx", lines[-2]
    losses = [float(m[1]) for line in lines if (m := re.fullmatch(r"step \d+ loss (\S+)", line))]
    # The SDK's default adapter seed is random and Adam at 1e-2 can overshoot on a step (measured with 0.25:
    # 5.72 -> 5.03 -> 5.81 once, 5.72 -> 5.13 -> 4.81 the next time): a step below the start is training.
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and min(losses[1:]) < losses[0]
    log = "\n".join(lines)
    restored, live = map(float, re.search(r"restored forward loss (\S+) live forward loss (\S+)", log).groups())
    assert abs(restored - live) <= 1e-6  # the restored state is the live state
    ephemeral = json.loads(re.search(r"ephemeral sampler tokens (\[.*\])", log)[1])
    saved_tokens = json.loads(re.search(r"saved sampler tokens (\[.*\])", log)[1])
    assert len(ephemeral) == 4 and ephemeral == saved_tokens  # same weights, greedy: same tokens

    # Every loss of the SDK's LossFnType trained, with and without loss_fn_config; each result carried
    # `loss:sum` and one logprob per target token.
    trained = re.findall(r"loss (\S+) (.+?) loss:sum (\S+) logprobs \[(.*)\]", log)
    assert [[name, json.loads(config)] for name, config, _, _ in trained] == LOSSES_OF[version]
    assert all(math.isfinite(float(total)) and lengths == "6, 6" for _, _, total, lengths in trained)
    # forward_backward_custom, on the restored client (a fresh optimizer): the custom loss (sum of squared logprobs)
    # falls below its start within its 3 steps. 0.38 reports it as loss:sum; 0.13 and 0.25 keep the server's
    # surrogate there, sum of -w * logprob with w = -2 * logprob: twice the custom loss, which holds only because
    # the cluster sums the loss as Tinker does.
    custom = [(float(a), float(b)) for a, b in re.findall(r"custom loss (\S+) loss:sum (\S+)", log)]
    assert len(custom) == 3 and min(loss for loss, _ in custom[1:]) < custom[0][0], custom
    factor = 1 if version == "0.38.0" else 2
    assert all(total == pytest.approx(factor * loss, rel=1e-3) for loss, total in custom), custom

    saved = assert_every_saved_checkpoint_verified(report)
    assert [c["tinker_path"].rsplit("/", 1)[1] for c in saved["state"]] == ["sdk-state"]
    samplers = {c["tinker_path"].rsplit("/", 1)[1]: c["url"] for c in saved["sampler"]}
    # A client of any SDK that leaves the LoRA flags at their defaults trains every module, the
    # unembedding included (the SDKs' default train_unembed=True reaches the engine).
    assert adapter_modules(samplers["sdk-sampler"]) == ATTN | MLP | UNEMBED
    if version == "0.38.0":
        assert set(samplers) == {"sdk-sampler", "no-train_unembed", "no-train_mlp", "no-train_attn"}
        for flag, family in (("train_unembed", UNEMBED), ("train_mlp", MLP), ("train_attn", ATTN)):
            assert adapter_modules(samplers[f"no-{flag}"]) == (ATTN | MLP | UNEMBED) - family, flag
        assert re.search(r"nothing to train: refused: .*train_attn, train_mlp and train_unembed are all False", log)
        assert re.search(r"stable_reinforce: refused: .*takes loss_fn=importance_sampling", log)
        # The run exported the client's last sampler checkpoint; its target_modules are what was trained.
        assert report["export"]["sampler_url"] == samplers["no-train_attn"] and report["export"]["passed"]
        assert set(report["export"]["target_modules"]) == MLP | UNEMBED
    else:
        assert list(samplers) == ["sdk-sampler"]
    assert alive_pids(state) == []


ATTN, MLP, UNEMBED = {"q_proj", "k_proj", "v_proj", "o_proj"}, {"gate_proj", "up_proj", "down_proj"}, \
    {"embed_tokens", "lm_head"}
LOSSES_OF = {
    version: [["importance_sampling", None], ["ppo", None],
              ["ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}], ["cispo", None],
              ["cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 2.0}], ["dro", {"beta": 0.05}]]
              + ([["gspo", None], ["gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}]]
                 if version == "0.38.0" else [])
    for version in SDK_VERSIONS}


def adapter_modules(sampler_url: str) -> set[str]:
    """The modules a committed sampler tarball has LoRA weights for."""
    with tarfile.open(sampler_url) as tar:
        weights = tar.extractfile("adapter_model.safetensors").read()
    return {key.split(".lora_")[0].rsplit(".", 1)[1] for key in safetensors.numpy.load(weights)}


def run_cookbook(tmp_path, txflow_env, reaper, run_id: str, module: str, *options: str, base_model: str = "tiny",
                 renderer: str = "role_colon") -> tuple[dict, str, Path]:
    """`txflow run custom` with a cookbook recipe (its module, `key=value` options) in the cookbook's environment:
    the report, the client's log and its log_path. Offline: Hugging Face reads only the local model; the
    cookbook's price lookup (https) goes to a closed port on loopback and fails as it does without a network.
    The cluster serves none of the shims the SDK matrix says the recipe does not need."""
    python = sdk_env("0.38.0", COOKBOOK_STEPS, name=COOKBOOK_ENV) / "bin" / "python"
    env = {**txflow_env, "HF_HUB_OFFLINE": "1", "https_proxy": f"http://127.0.0.1:{free_port()}",
           "no_proxy": "127.0.0.1,localhost", SKIP_ENV: unneeded_shims(module)}
    state = reaper.watch(tmp_path / "state")
    log_path = tmp_path / f"{run_id}-log"
    result = run_txflow(["run", "custom", "--base-model", base_model, "--run-id", run_id, "--state-dir", str(state),
                         "--checkpoints", str(tmp_path / "ckpt"), "--client", module, "--client-python", str(python),
                         *ONE_PROCESS,
                         "--client-arg=base_url={base_url}", "--client-arg=model_name={base_model}",
                         f"--client-arg=renderer_name={renderer}", f"--client-arg=log_path={log_path}",
                         *[f"--client-arg={option}" for option in options], "--json"], env, tmp_path, timeout=1500)
    log = "\n".join(client_lines(state)) if (state / "logs" / "client.log").exists() else ""
    assert result.returncode == 0, result.stderr[-3000:] + "\n--- client.log ---\n" + log[-3000:]
    assert "tinker 0.38.0)" in result.stderr
    api_log = (state / "logs" / "api.log").read_text()
    left_out = unneeded_shims(module).replace(",", ", ")
    assert f"Tinker SDK shims left out ({SKIP_ENV}): {left_out}\n" in api_log, api_log[:3000]
    assert alive_pids(state) == []
    return json.loads(result.stdout), log, log_path


def test_the_tinker_cookbook_supervised_trainer_runs_as_a_client(tmp_path, txflow_env, reaper):
    """The cookbook's own supervised-learning CLI (`tinker_cookbook.recipes.chat_sl.train`) on a local
    JSONL of conversations and the local model, rendered with `role_colon` (the tiny tokenizer has no
    Qwen3 chat tokens)."""
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in CONVERSATIONS))
    report, log, log_path = run_cookbook(tmp_path, txflow_env, reaper, "cookbook-sl",
                                         "tinker_cookbook.recipes.chat_sl.train", f"dataset={data}", "batch_size=2",
                                         "max_length=128", "lora_rank=8", "learning_rate=0.01")
    assert report["status"] == "passed" and "Training completed successfully" in log
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    # 4 conversations in batches of 2: two optimizer steps, each with a finite training loss.
    assert [m["step"] for m in metrics] == [0, 1] and all(math.isfinite(m["train_mean_nll"]) for m in metrics)
    saved = assert_every_saved_checkpoint_verified(report)
    assert [c["tinker_path"].rsplit("/", 1)[1] for c in saved["state"] + saved["sampler"]] == ["final", "final"]


def test_the_tinker_cookbook_rl_recipe_runs_as_a_client_with_cispo(tmp_path, txflow_env, reaper):
    """The cookbook's RL recipe (`tinker_cookbook.recipes.math_rl.train`, its synthetic arithmetic environment)
    for 3 steps with loss_fn=cispo: sampling, the cookbook's RL datums and its loss through the cluster. Its
    default loss, stable_reinforce, is refused with one line (see the 0.38 client above and docs/tinker-api.md)."""
    report, _, log_path = run_cookbook(tmp_path, txflow_env, reaper, "cookbook-rl",
                                       "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", "loss_fn=cispo",
                                       "groups_per_batch=4", "group_size=4", "max_tokens=5", "max_steps=3",
                                       "lora_rank=8", "learning_rate=0.001", "eval_every=0")
    assert report["status"] == "passed"
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "env/all/reward/total" in m]
    assert len(steps) == 3 and all(math.isfinite(m["env/all/reward/total"]) for m in steps), metrics
    saved = assert_every_saved_checkpoint_verified(report)
    assert saved["state"] and saved["sampler"]
    # The recipe leaves the LoRA flags at the SDK's defaults: the unembedding trained too, and exported.
    assert report["export"]["passed"] and {"embed_tokens", "lm_head"} <= set(report["export"]["target_modules"])


# What each SDK does without one shim: the call it fails at (the last line its client printed before)
# and what it fails with. 2 is an error inside the API (upstream's 422 handler cannot encode a protobuf
# body), which the SDK retries without end: the probe stops there.
WITHOUT_SHIM = {
    1: ("tinker ", "Error code: 404"),  # the client_config handshake, before anything else
    2: ("created training client", "UnicodeDecodeError"),  # the protobuf forward_backward
    3: ("created training client", "only supports as proto"),  # forward_backward's result, as JSON
    4: ("restored forward loss", "asample promises always carry sample_sequence_ids"),  # sample
    5: ("saved sampler tinker://", "Error code: 404"),  # create_sampling_client(model_path=...)
    6: ("saved state tinker://", "'loc': ['body', 'model_id']"),  # create_training_client_from_state
    7: ("saved sampler tokens", "Error code: 404"),  # leaving `with ServiceClient()`: finishing the session
}
SHIMS = set(WITHOUT_SHIM)


def matrix_needs_shims() -> dict[str, set[int]]:
    """The shims each row of the SDK matrix needs (docs/sdk-matrix.json, which the docs render): by SDK
    version, and for the cookbook's rows by the module their client runs."""
    rows = json.loads((Path(__file__).parents[1] / "docs" / "sdk-matrix.json").read_text())
    return {row["module"] if row.get("module") else row["sdk"].split("==")[1]: set(row["needs_shims"])
            for row in rows}


def unneeded_shims(key: str) -> str:
    """`TXFLOW_TINKER_COMPAT_SKIP` for what the SDK matrix says `key` does not need ("0": none left out)."""
    return ",".join(map(str, sorted(SHIMS - matrix_needs_shims()[key]))) or "0"


class ShimlessApis:
    """Extra API servers of one running cluster, each with a set of shims left out: the same command,
    environment and database as the cluster's own API (the engine serves them all), on other ports."""

    def __init__(self, cluster, skips: list[str], logs: Path):
        api = next(p for p in cluster.processes if p.role == "api")
        argv = [a.decode() for a in Path(f"/proc/{api.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")]
        env = dict(item.split("=", 1) for item in Path(f"/proc/{api.pid}/environ").read_text().split("\0")
                   if "=" in item)
        env.pop(WAKE_ENV, None)  # the cluster's API owns the wake channel; these poll, as upstream does
        env.pop(LISTEN_FD_ENV, None)  # the cluster's API inherited its socket; these bind --port themselves
        self.procs, self.ports, self.logs = [], {}, {}
        for skip in skips:
            port = free_port()
            command = list(argv)
            command[command.index("--port") + 1] = str(port)
            self.logs[skip] = logs / f"api-without-{skip.replace(',', '-')}.log"
            self.procs.append(groups.spawn(command, self.logs[skip], env=lifeline.child_env(env | {SKIP_ENV: skip})))
            self.ports[skip] = port

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        for skip, port in self.ports.items():
            while not port_open("127.0.0.1", port):
                assert time.monotonic() < deadline, self.logs[skip].read_text()[-2000:]
                time.sleep(0.2)
            said = f"Tinker SDK shims left out ({SKIP_ENV}): {skip.replace(',', ', ')}\n"
            assert (said in self.logs[skip].read_text()) == (skip != "0"), self.logs[skip].read_text()[-2000:]

    def stop(self) -> None:
        groups.stop_groups([p.pid for p in self.procs], grace_s=2.0)


PROGRESS = ("tinker ", "created training client", "step ", "saved state", "restored forward loss",
            "ephemeral sampler tokens", "saved sampler", "done")


def progress(lines: list[str]) -> list[str]:
    """What the client printed of its progress (not its traceback, not the API's log)."""
    return [line for line in lines if line.startswith(PROGRESS)]


def probe(cluster, version: str, apis: ShimlessApis, skip: str, out: Path) -> tuple[int | None, list[str], str]:
    """The core of `version`'s client (train, save, restore, sample, finish) against the API without
    `skip`: its exit code (None: stopped while the SDK retried a server error), its output lines, and
    what that API logged meanwhile."""
    base_url = f"http://127.0.0.1:{apis.ports[skip]}"
    command = [str(sdk_env(version) / "bin" / "python"), str(CLIENTS / CLIENT_FOR[version]), "--base-url", base_url,
               "--model-name", cluster.base_model_path, "--steps", "1", "--core-only"]
    api_log = apis.logs[skip]
    logged_before = len(api_log.read_text())
    with open(out, "w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, cwd=CLIENTS,
                                env=client_env(cluster) | {"TINKER_BASE_URL": base_url})
        deadline = time.monotonic() + 180
        try:
            while proc.poll() is None:
                if "Exception in ASGI application" in api_log.read_text()[logged_before:]:
                    break  # the server failed the request; the SDK would retry it for ever
                assert time.monotonic() < deadline, f"{version} without {skip} neither finished nor failed"
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    code = None if proc.returncode == -signal.SIGKILL else proc.returncode
    return code, out.read_text().splitlines(), api_log.read_text()[logged_before:]


def test_each_sdk_needs_exactly_the_shims_the_matrix_names(tmp_path, reaper):
    """The SDK matrix's "needs shims" (docs/sdk-matrix.json), proven: each SDK's client runs with every shim
    it is not said to need left out, and fails, at the call that shim serves, with any one it is said to need
    left out. One cluster serves every probe through extra API processes, one per set of shims left out."""
    needs = {v: n for v, n in matrix_needs_shims().items() if v in SDK_VERSIONS}
    assert set(needs) == set(SDK_VERSIONS), needs
    # Every probe leaves its models behind until its session times out: room for all of them.
    cfg = RunConfig(base_model="tiny", processes=1, lora_adapters=64, run_id="shims", state_dir=str(tmp_path / "state"),
                    checkpoints=str(tmp_path / "ckpt")).resolved()
    reaper.watch(cfg.state_dir)
    unneeded = {v: unneeded_shims(v) for v in needs}
    skips = sorted(set(unneeded.values()) | {str(s) for n in needs.values() for s in n})
    handle = provision_coordinator.fn(cfg, LocalLauncher(), resolve_base_model(cfg.base_model))
    apis = None
    try:
        launch_workers.fn(cfg, handle)
        apis = ShimlessApis(handle.cluster, skips, tmp_path)
        apis.wait_ready()
        for version, needed in needs.items():
            code, lines, _ = probe(handle.cluster, version, apis, unneeded[version], tmp_path / f"{version}-ok.log")
            assert code == 0 and progress(lines)[-1] == "done", \
                f"tinker {version} without shims {unneeded[version]}:\n" + "\n".join(lines[-30:])
            assert progress(lines)[-2].startswith("saved sampler tokens")
            for shim in sorted(needed):
                last_line, error = WITHOUT_SHIM[shim]
                code, lines, api_logged = probe(handle.cluster, version, apis, str(shim),
                                                tmp_path / f"{version}-{shim}.log")
                assert code != 0 and "done" not in lines, f"tinker {version} ran without shim {shim}"
                assert error in "\n".join(lines) + api_logged, (version, shim, lines[-30:], api_logged[-2000:])
                assert progress(lines)[-1].startswith(last_line), (version, shim, progress(lines))
    finally:
        if apis is not None:
            apis.stop()
        teardown.fn(handle, cfg.state_dir)
    assert alive_pids(cfg.state_dir) == []
    assert all(p.poll() is not None for p in apis.procs)
