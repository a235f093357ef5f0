"""Every public method of a Tinker SDK's ServiceClient, TrainingClient, SamplingClient and RestClient, and every
command of its `tinker` CLI, called against a cluster; one JSON line per method or command on stdout.

Run under the SDK's own interpreter (tests/sdk_envs.py); it knows nothing of txflow. The methods and the commands
are found by introspection (the classes' public callables, the CLI's click groups), so a method or a command a
newer SDK adds, and this file has no probe for, comes out as "unprobed". Each probe calls the method and checks
what it did, not only that it returned: a result is one of

- works: the call returned and its check held (`detail` says what was checked);
- refused: the call raised, as its probe expects, with `detail` the message the user sees (the cluster's,
  when it answered);
- not applicable: client-side only, or about Tinker's hosted service, with the reason (not called);
- broken: a check failed, or a call a probe expects to work raised, or one it expects refused did not;
- unprobed: no probe here for this method or command.

A method `x_async` is called too, through the same probe as `x`, and its coroutine awaited; each gets its own row.

Usage: python compat_probe.py --base-url URL --model-name MODEL; the key comes from TINKER_API_KEY.
"""

import argparse
import asyncio
import inspect
import io
import json
import math
import os
import re
import tarfile
import tempfile
import urllib.request

import tinker
from client_common import BATCH, PROMPT, datum
from tinker import types

try:
    from tinker import RestClient
except ImportError:  # 0.13 and 0.25 do not export it at the top
    from tinker.lib.public_interfaces.rest_client import RestClient

CLASSES = {"ServiceClient": tinker.ServiceClient, "TrainingClient": tinker.TrainingClient,
           "SamplingClient": tinker.SamplingClient, "RestClient": RestClient}
LOOP = asyncio.new_event_loop()
ADAM = types.AdamParams(learning_rate=1e-2)
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0, seed=0)

NOT_APPLICABLE = {
    "get_telemetry": "client-side telemetry object; sends nothing to the cluster (off with TINKER_TELEMETRY=0)",
    "get_console_url": "a link into Tinker's hosted web console, which a self-hosted cluster does not have",
    "on_queue_state_change": "a hook the SDK calls with the server's queue state, for a subclass to override",
    "create": "the SDK's internal constructor (takes its connection holder); ServiceClient.create_sampling_client "
              "is the public way",
}
CLI_NOT_APPLICABLE = {
    "checkpoint push-hf": "uploads to the Hugging Face Hub, which is outside this cluster (and this test's network); "
                          "it downloads the checkpoint first, as `checkpoint download` does",
}


class Broken(Exception):
    pass


def check(condition, what):
    if not condition:
        raise Broken(what)


def resolve(value):
    """A value, whatever the call returned: a coroutine is awaited, an SDK future waited for (repeatedly)."""
    while True:
        if inspect.iscoroutine(value):
            value = LOOP.run_until_complete(value)
        elif "Future" in type(value).__name__ and callable(getattr(value, "result", None)):
            value = value.result()
        else:
            return value


def message(exc) -> str:
    """What the user reads of a refusal: the cluster's one-line `detail` when it answered, else the SDK's text."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return body["detail"]
    return str(exc)


def scrub(text: str) -> str:
    """The message with what differs between runs (ids, paths, ports, times) replaced, for the committed table."""
    text = re.sub(r"tinker://[^\s'\"),]+", "tinker://<path>", text)
    text = re.sub(r"model_[0-9a-f]{8}", "<run>", text)
    text = re.sub(r"https?://127\.0\.0\.1:\d+", "<cluster>", text)
    text = re.sub(r"/[^\s'\"]*/tiny-[^\s'\"]*", "<base model>", text)
    return text.strip()


class Context:
    """What the probes share: a trained client `training` whose weights never change after setup, its saved
    state and sampler checkpoints, a sampling client of that sampler, a rest client."""

    def __init__(self, base_url, model):
        self.base_url, self.model = base_url, model
        self.service = tinker.ServiceClient(base_url=base_url)
        self.rest = resolve(self.service.create_rest_client())
        self.batch = [datum(tokens) for tokens in BATCH]
        self.training = self.new_training_client()
        resolve(self.training.forward_backward(self.batch, "cross_entropy"))
        resolve(self.training.optim_step(ADAM))
        self.state = resolve(self.training.save_state("probe-state")).path
        self.sampler = resolve(self.training.save_weights_for_sampler("probe-sampler")).path
        self.loss = self.loss_of(self.training)
        self.sampling = resolve(self.service.create_sampling_client(model_path=self.sampler))
        self.greedy = self.greedy_of(self.sampling)
        self.scratch_client = None
        self.counter = 0

    def new_training_client(self, **kwargs):
        return resolve(self.service.create_lora_training_client(base_model=self.model, rank=8, **kwargs))

    def scratch(self):
        """A training client the probes may change (one, reused: each adapter costs the cluster a slot)."""
        if self.scratch_client is None:
            self.scratch_client = self.new_training_client()
        return self.scratch_client

    def name(self, stem):
        self.counter += 1
        return f"probe-{stem}-{self.counter}"

    def loss_of(self, client):
        output = resolve(client.forward(self.batch, "cross_entropy"))
        return -sum(lp for out in output.loss_fn_outputs for lp in out["logprobs"].tolist())

    def greedy_of(self, sampling):
        response = resolve(sampling.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=1,
                                           sampling_params=GREEDY))
        return list(response.sequences[0].tokens)

    def same_loss(self, client, what):
        loss = self.loss_of(client)
        check(abs(loss - self.loss) <= 1e-5 * max(1.0, abs(self.loss)), f"{what}: loss {loss} != {self.loss}")

    def same_greedy(self, sampling, what):
        tokens = self.greedy_of(sampling)
        check(tokens == self.greedy and len(tokens) == 4, f"{what}: greedy {tokens} != {self.greedy}")

    def run_id(self):
        return self.training.model_id


PROBES = {}


def probe(*names, refused=False):
    """Register `fn(ctx, call)` for the methods `names` (and their `_async` twins); `call(obj, *args)` calls the
    method under probe on `obj` and resolves its result. With `refused`, the call must raise."""

    def register(fn):
        for name in names:
            PROBES[name] = (fn, refused)
        return fn

    return register


# --- ServiceClient ----------------------------------------------------------------------------------------


@probe("create_lora_training_client")
def _(ctx, call):
    client = call(ctx.service, base_model=ctx.model, rank=4)
    info = resolve(client.get_info())
    check(info.lora_rank == 4 and info.model_id == client.model_id, f"get_info {info}")
    return "a new LoRA adapter of the rank asked (get_info)"


@probe("create_rest_client")
def _(ctx, call):
    runs = resolve(call(ctx.service).list_training_runs(limit=1000)).training_runs
    check(ctx.run_id() in [r.training_run_id for r in runs], "the run is not listed")
    return "a RestClient that lists this session's training run"


@probe("create_sampling_client")
def _(ctx, call):
    owner = ctx.service if call.cls == "ServiceClient" else ctx.training
    ctx.same_greedy(call(owner, model_path=ctx.sampler), "sampler")
    return "samples the saved sampler weights (greedy tokens as the sampler's)"


@probe("create_training_client_from_state")
def _(ctx, call):
    ctx.same_loss(call(ctx.service, ctx.state), "restored")
    return "a new client with the state's weights (forward loss equal; a fresh optimizer: test_tinker_semantics_e2e)"


@probe("create_training_client_from_state_with_optimizer")
def _(ctx, call):
    ctx.same_loss(call(ctx.service, ctx.state), "restored")
    return "a new client with the state's weights (forward loss equal; the optimizer: test_tinker_semantics_e2e)"


@probe("get_server_capabilities")
def _(ctx, call):
    owner = ctx.service if call.cls == "ServiceClient" else ctx.rest
    models = [m.model_name for m in call(owner).supported_models]
    check(ctx.model in models, f"{ctx.model} not in {models}")
    return "lists the cluster's base model"


@probe("close")
def _(ctx, call):
    other = tinker.ServiceClient(base_url=ctx.base_url)
    check(call(other, "success") is None, "close returned something")
    return "acknowledged (the session's adapters are freed when its heartbeats stop)"


@probe("copy_weights", refused=True)
def _(ctx, call):
    os.environ["TINKER_PROJECT_ID"] = "probe-project"  # else the SDK refuses before it asks the cluster
    try:
        call(ctx.service if call.cls == "ServiceClient" else ctx.rest, ctx.state)
    finally:
        del os.environ["TINKER_PROJECT_ID"]


@probe("create_custom_loss")
def _(ctx, call):
    def squared(logprobs):
        loss = (logprobs ** 2).sum()
        return loss, {"custom/squared:sum": loss}

    # The cluster declares server-side custom losses off (SDK shim 1 of `tinker_compat`): the SDK runs the loss in the
    # client.
    handle = call(ctx.service, squared, {"logprobs": 1})
    output = resolve(ctx.scratch().forward_backward_custom(ctx.batch, handle))
    check(output.metrics["custom/squared:sum"] > 0 and math.isfinite(output.metrics["loss:sum"]), f"{output.metrics}")
    return "a loss handle that forward_backward_custom trains with (the loss runs in the client)"


# --- TrainingClient ---------------------------------------------------------------------------------------


@probe("forward")
def _(ctx, call):
    output = call(ctx.training, ctx.batch, "cross_entropy")
    logprobs = [out["logprobs"].tolist() for out in output.loss_fn_outputs]
    check([len(lp) for lp in logprobs] == [len(t) - 1 for t in BATCH], "one logprob per target token")
    check(all(x <= 0 for lp in logprobs for x in lp), "logprobs <= 0")
    check(abs(-sum(map(sum, logprobs)) - ctx.loss) < 1e-5 * ctx.loss, "the same weights give the same loss")
    return "one logprob per target token, the same for the same weights"


@probe("forward_backward")
def _(ctx, call):
    output = call(ctx.scratch(), ctx.batch, "cross_entropy")
    total = -sum(lp for out in output.loss_fn_outputs for lp in out["logprobs"].tolist())
    check(abs(output.metrics["loss:sum"] - total) <= 1e-4 * total, f"loss:sum {output.metrics} != {total}")
    return "loss:sum is the summed NLL of the targets"


@probe("forward_backward_custom")
def _(ctx, call):
    def squared(data, logprobs_list):
        loss = sum((logprobs ** 2).sum() for logprobs in logprobs_list)
        return loss, {"squared:sum": float(loss.detach())}

    output = call(ctx.scratch(), ctx.batch, squared)
    check(output.metrics["squared:sum"] > 0 and math.isfinite(output.metrics["loss:sum"]), f"{output.metrics}")
    return "the client's loss and its metrics come back"


@probe("optim_step")
def _(ctx, call):
    client = ctx.scratch()
    before = ctx.loss_of(client)
    resolve(client.forward_backward(ctx.batch, "cross_entropy"))
    call(client, types.AdamParams(learning_rate=1e-3))  # small: Adam at 1e-2 can overshoot a step
    after = ctx.loss_of(client)
    check(after < before, f"loss {before} -> {after}")
    return "the loss falls after a step"


@probe("get_info")
def _(ctx, call):
    info = call(ctx.training)
    check((info.model_id, info.lora_rank) == (ctx.run_id(), 8), f"{info}")
    return "the model's id and LoRA rank"


@probe("get_tokenizer")
def _(ctx, call):
    tokenizer = call(ctx.training if call.cls == "TrainingClient" else ctx.sampling)
    check(tokenizer.decode(tokenizer.encode("hello world")).strip().endswith("hello world"), "round trip")
    return "the base model's tokenizer (encode, decode)"


@probe("load_state")
def _(ctx, call):
    client = ctx.scratch()
    call(client, ctx.state)
    ctx.same_loss(client, "loaded")
    return "the state's weights (forward loss equal; a fresh optimizer: test_tinker_semantics_e2e)"


@probe("load_state_with_optimizer")
def _(ctx, call):
    client = ctx.scratch()
    call(client, ctx.state)
    ctx.same_loss(client, "loaded")
    return "the state's weights (forward loss equal; its optimizer: test_tinker_semantics_e2e)"


@probe("save_state")
def _(ctx, call):
    client = ctx.scratch()
    path = call(client, ctx.name("state")).path
    check(re.fullmatch(rf"tinker://{client.model_id}/weights/probe-state-\d+", path), path)
    listed = [c.tinker_path for c in resolve(ctx.rest.list_checkpoints(client.model_id)).checkpoints]
    check(path in listed, "not listed")
    return "tinker://<run>/weights/<name>, listed by list_checkpoints"


@probe("save_weights_for_sampler")
def _(ctx, call):
    path = call(ctx.training, ctx.name("sampler")).path
    check(re.fullmatch(rf"tinker://{ctx.run_id()}/sampler_weights/probe-sampler-\d+", path), path)
    ctx.same_greedy(resolve(ctx.service.create_sampling_client(model_path=path)), "saved")
    return "tinker://<run>/sampler_weights/<name>; samples the same weights"


@probe("save_weights_and_get_sampling_client", "save_weights_and_get_sampling_client_submit")
def _(ctx, call):
    ctx.same_greedy(call(ctx.training), "ephemeral")
    return "a sampling client of the current weights (greedy tokens as the saved sampler's)"


def export_files(ctx, path):
    """The files of an external-weights export, downloaded without the key through its signed URLs."""
    response = resolve(ctx.rest.get_external_weights_urls(path))
    files = {}
    for name, url in response.urls.items():
        with urllib.request.urlopen(url, timeout=60) as answer:
            files[name] = answer.read()
    return files


@probe("save_weights_external")
def _(ctx, call):
    path = call(ctx.training, ctx.name("external"), ttl_seconds=3600).path
    check(re.fullmatch(rf"tinker://{ctx.run_id()}/external_weights/probe-external-\d+", path), path)
    files = export_files(ctx, path)
    check({"adapter_model.safetensors", "adapter_config.json"} <= set(files), f"{set(files)}")
    resolve(ctx.rest.delete_checkpoint_from_tinker_path(path))
    return "tinker://<run>/external_weights/<name>: the PEFT adapter's files; deleted on request"


# --- SamplingClient ---------------------------------------------------------------------------------------


@probe("sample")
def _(ctx, call):
    response = call(ctx.sampling, prompt=types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=GREEDY)
    sequence = response.sequences[0]
    tokens = list(sequence.tokens)
    check(tokens == ctx.greedy, f"{tokens}")
    # The sampled tokens' logprobs are the training client's for them: the sampler samples the trained weights.
    full = PROMPT + tokens
    targets = resolve(ctx.training.forward([types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})], "cross_entropy"))
    expected = targets.loss_fn_outputs[0]["logprobs"].tolist()[-len(tokens):]
    check(all(abs(a - b) < 1e-3 for a, b in zip(sequence.logprobs, expected, strict=True)),
          f"{sequence.logprobs} != {expected}")
    return "greedy tokens with the trained weights' logprobs"


@probe("compute_logprobs")
def _(ctx, call):
    logprobs = call(ctx.sampling, types.ModelInput.from_ints(PROMPT))
    targets = resolve(ctx.training.forward([types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * (len(PROMPT) - 1)})], "cross_entropy"))
    expected = targets.loss_fn_outputs[0]["logprobs"].tolist()
    check(logprobs[0] is None and all(abs(a - b) < 1e-3 for a, b in zip(logprobs[1:], expected, strict=True)),
          f"{logprobs} != {expected}")
    return "each prompt token's logprob, as the training client computes it"


@probe("get_base_model")
def _(ctx, call):
    check(call(ctx.sampling) == ctx.model, "base model")
    return "the base model's name"


@probe("get_sampler_handle")
def _(ctx, call):
    handle = call(ctx.sampling)
    ctx.same_greedy(tinker.SamplingClient.from_sampler_handle(handle, api_key=os.environ["TINKER_API_KEY"]),
                    "from handle")
    return "a handle from which from_sampler_handle samples the same weights"


@probe("from_sampler_handle")
def _(ctx, call):
    handle = ctx.sampling.get_sampler_handle()
    ctx.same_greedy(call(tinker.SamplingClient, handle, api_key=os.environ["TINKER_API_KEY"]), "from handle")
    return "a sampling client of the same weights"


# --- RestClient -------------------------------------------------------------------------------------------


@probe("list_training_runs")
def _(ctx, call):
    response = call(ctx.rest, limit=1000)
    check(ctx.run_id() in [r.training_run_id for r in response.training_runs], "not listed")
    return "lists the session's training runs"


@probe("get_training_run")
def _(ctx, call):
    run = call(ctx.rest, ctx.run_id())
    check((run.lora_rank, run.last_checkpoint.tinker_path) == (8, ctx.state), f"{run}")
    return "the run's LoRA rank and last checkpoint"


@probe("get_training_run_by_tinker_path")
def _(ctx, call):
    run = call(ctx.rest, ctx.state)
    check(run.training_run_id == ctx.run_id(), f"{run}")
    return "the checkpoint's run"


@probe("list_checkpoints")
def _(ctx, call):
    paths = {c.tinker_path for c in call(ctx.rest, ctx.run_id()).checkpoints}
    check({ctx.state, ctx.sampler} <= paths, f"{paths}")
    return "the run's state and sampler checkpoints"


@probe("list_user_checkpoints")
def _(ctx, call):
    paths = {c.tinker_path for c in call(ctx.rest, limit=1000).checkpoints}
    check({ctx.state, ctx.sampler} <= paths, f"{paths}")
    return "every checkpoint, this run's among them"


@probe("get_weights_info_by_tinker_path")
def _(ctx, call):
    info = call(ctx.rest, ctx.state)
    check(info.lora_rank == 8 and getattr(info, "train_mlp", True) is True, f"{info}")
    return "the checkpoint's LoRA rank and modules"


def adapter_files(url):
    with urllib.request.urlopen(url, timeout=60) as response:  # no key: the URL is signed
        body = response.read()
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        return set(tar.getnames())


@probe("get_checkpoint_archive_url", "get_checkpoint_archive_url_from_tinker_path")
def _(ctx, call):
    if call.name.startswith("get_checkpoint_archive_url_from_tinker_path"):
        url = call(ctx.rest, ctx.sampler)
    else:
        url = call(ctx.rest, ctx.run_id(), "probe-sampler")
    files = adapter_files(url.url)
    check({"adapter_model.safetensors", "adapter_config.json"} <= files, f"{files}")
    return "a signed URL; downloaded without the key, the PEFT adapter's files"


def still_listed(ctx, path):
    check(path in {c.tinker_path for c in resolve(ctx.rest.list_checkpoints(ctx.run_id())).checkpoints},
          f"{path} is gone")


@probe("delete_checkpoint", "delete_checkpoint_from_tinker_path", refused=True)
def _(ctx, call):
    try:
        if call.name.startswith("delete_checkpoint_from_tinker_path"):
            call(ctx.rest, ctx.state)
        else:
            call(ctx.rest, ctx.run_id(), "weights/probe-state")
    finally:
        still_listed(ctx, ctx.state)


@probe("publish_checkpoint_from_tinker_path", "unpublish_checkpoint_from_tinker_path", refused=True)
def _(ctx, call):
    call(ctx.rest, ctx.sampler)


@probe("set_checkpoint_ttl_from_tinker_path", refused=True)
def _(ctx, call):
    call(ctx.rest, ctx.state, 7200)


@probe("get_sampler")
def _(ctx, call):
    sampler_id = ctx.sampling._sampling_session_id
    response = call(ctx.rest, sampler_id)
    check(response.base_model == ctx.model, f"{response}")
    return "the sampler's base model"


def owners(ctx, session_ids):
    return [s for s in session_ids if ctx.run_id() in resolve(ctx.rest.get_session(s)).training_run_ids]


@probe("list_sessions")
def _(ctx, call):
    check(len(owners(ctx, call(ctx.rest, limit=1000).sessions)) == 1, "no one session holds the run")
    return "the sessions; exactly one holds this run"


@probe("get_session")
def _(ctx, call):
    sessions = resolve(ctx.rest.list_sessions(limit=1000)).sessions
    held = [s for s in sessions if ctx.run_id() in call(ctx.rest, s).training_run_ids]
    check(len(held) == 1, f"{held}")
    return "the session's training runs"


@probe("search_sessions", refused=True)
def _(ctx, call):
    call(ctx.rest, types.SessionSearchRequest())


@probe("assign_session_project", refused=True)
def _(ctx, call):
    call(ctx.rest, "session_none", "project_none")


@probe("export_session_trace", refused=True)
def _(ctx, call):
    call(ctx.rest, resolve(ctx.rest.list_sessions(limit=1)).sessions[0])


@probe("get_audit_log", "get_billing_usage", "get_current_checkpoint_storage_usage", refused=True)
def _(ctx, call):
    if call.name.startswith("get_billing_usage"):
        call(ctx.rest, "2026-01-01", "2026-02-01")
    else:
        call(ctx.rest)


@probe("get_external_weights_urls")
def _(ctx, call):
    path = resolve(ctx.training.save_weights_external(ctx.name("external"))).path
    urls = call(ctx.rest, path).urls
    files = {}
    for name, url in urls.items():
        with urllib.request.urlopen(url, timeout=60) as answer:  # no key: each URL is signed for its file
            files[name] = answer.read()
    check(json.loads(files["adapter_config.json"])["r"] == 8 and len(files["adapter_model.safetensors"]) > 0,
          f"{set(files)}")
    resolve(ctx.rest.delete_checkpoint_from_tinker_path(path))
    return "one signed URL per file of the export, each downloadable without the key"


@probe("whoami", refused=True)
def _(ctx, call):
    call(ctx.rest)


# --- the methods --------------------------------------------------------------------------------------------


class Call:
    """Calls method `name` on an object and resolves the result; `cls` is the class under probe."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def __call__(self, obj, *args, **kwargs):
        return resolve(getattr(obj, self.name)(*args, **kwargs))


def public_methods(cls):
    return sorted(n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v))


def run_method(ctx, cls, name):
    base = name.removesuffix("_async")
    if base in NOT_APPLICABLE:
        return "not applicable", NOT_APPLICABLE[base]
    if base not in PROBES:
        return "unprobed", "no probe in tests/clients/compat_probe.py"
    fn, refused = PROBES[base]
    try:
        detail = fn(ctx, Call(cls, name))
    except Broken as exc:
        return "broken", scrub(str(exc))
    except Exception as exc:  # what the user would see raised
        if refused:
            # Said by the SDK itself when no answer from the cluster came with it.
            said_by = "" if getattr(exc, "status_code", None) else "the SDK: "
            return "refused", scrub(said_by + (message(exc).splitlines()[0] if message(exc) else type(exc).__name__))
        return "broken", scrub(f"{type(exc).__name__}: {message(exc)}")[:300]
    if refused:
        return "broken", "expected a refusal, the call returned"
    return "works", detail


# --- the CLI ----------------------------------------------------------------------------------------------


def cli_commands():
    import click
    from tinker.cli.__main__ import main_cli

    def walk(group, prefix):
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            if isinstance(command, click.Group):
                yield from walk(command, prefix + (name,))
            else:
                yield " ".join(prefix + (name,)), command

    return main_cli, dict(walk(main_cli, ()))


def invoke(main_cli, args, home, input=None):
    """The command's (exit code, output, error message) as the CLI prints them; --format json."""
    from click.testing import CliRunner
    from tinker.cli.exceptions import TinkerCliError

    result = CliRunner().invoke(main_cli, ["--format", "json", *args], input=input, env={"HOME": home},
                                catch_exceptions=True)
    error = None
    if isinstance(result.exception, TinkerCliError):
        details = result.exception.details or ""
        served = re.search(r"""'detail': ['"](.*)['"]\}""", details)
        if served is None and details and "\n" not in details.strip():
            served = [None, details.strip().removeprefix("Details: ")]
        error = result.exception.message + (f": {served[1]}" if served else "")
    elif result.exception is not None and not isinstance(result.exception, SystemExit):
        error = f"{type(result.exception).__name__}: {result.exception}"
    return result.exit_code, result.output, error


def json_of(output):
    return json.loads(output[output.index("{") if output.lstrip().startswith("{") else output.index("["):])


def cli_probes(ctx, home, download_dir):
    """Per command: (argv, check(output) -> detail, or None for a command expected to be refused)."""
    run, state, sampler = ctx.run_id(), ctx.state, ctx.sampler

    def listed(output):
        paths = {c["tinker_path"] for c in json_of(output)["checkpoints"]}
        check({state, sampler} <= paths, f"{paths}")
        return "the run's state and sampler checkpoints"

    def run_listed(output):
        check(run in json.dumps(json_of(output)), "run not listed")
        return "lists the run"

    def run_info(output):
        info = json_of(output)
        check(info["training_run_id"] == run and info["last_checkpoint"]["tinker_path"] == state, f"{info}")
        return "the run, its LoRA rank and last checkpoints"

    def checkpoint_info(output):
        check(json_of(output)["tinker_path"] == state, output)
        return "the checkpoint"

    def downloaded(path):
        def files(output):
            target = os.path.join(download_dir, path.removeprefix("tinker://").replace("/", "_"))
            found = set(os.listdir(target))
            check({"adapter_model.safetensors", "adapter_config.json"} <= found, f"{found}")
            return f"the {'state' if path == state else 'sampler'} checkpoint's PEFT adapter files"
        return files

    def version(output):
        check(tinker.__version__ in output, output)
        return "the SDK's version"

    def models(output):
        check(ctx.model in output, output)
        return "the cluster's base model"

    def status(output):
        check("Tinker accessible: yes" in output, output)
        return "the cluster answers with the key"

    def deleted_refused(output):
        # The CLI reports a failed deletion in its output and exits 0.
        still_listed(ctx, state)
        failed = json_of(output)["failed"]
        check(len(failed) == 1 and failed[0]["tinker_path"] == state, output)
        served = re.search(r"""'detail': ['"](.*)['"]\}""", failed[0]["error"])
        raise CliRefused(f"failed to delete: {served[1] if served else failed[0]['error']}")

    # Older CLIs exit 1 with the refusal instead; the checkpoint must still be there either way.
    deleted_refused.refusal_expected = True
    deleted_refused.refused = lambda: still_listed(ctx, state)

    # 0.38's download takes a training checkpoint (through external weights) and refuses a sampler one itself;
    # the older ones download a sampler checkpoint's archive.
    import tinker.cli.commands.checkpoint as checkpoint_commands

    download = state if "external_weights" in inspect.getsource(checkpoint_commands) else sampler
    return {
        "version": (["version"], version),
        "run list": (["run", "list", "--limit", "0"], run_listed),
        "run info": (["run", "info", run], run_info),
        "checkpoint list": (["checkpoint", "list", "--run-id", run], listed),
        "checkpoint info": (["checkpoint", "info", state], checkpoint_info),
        "checkpoint publish": (["checkpoint", "publish", sampler], None),
        "checkpoint unpublish": (["checkpoint", "unpublish", sampler], None),
        "checkpoint set-ttl": (["checkpoint", "set-ttl", state, "--ttl", "7200"], None),
        "checkpoint delete": (["checkpoint", "delete", state, "--yes"], deleted_refused),
        "checkpoint download": (["checkpoint", "download", download, "--output", download_dir], downloaded(download)),
        "model list": (["model", "list"], models),
        "auth status": (["auth", "status"], status),
        "auth whoami": (["auth", "whoami"], None),
        "auth login": (["auth", "login"], None),
        "auth logout": (["auth", "logout"], None),
        "billing usage": (["billing", "usage", "2026-01-01", "2026-02-01"], None),
        "billing checkpoint-storage": (["billing", "checkpoint-storage"], None),
        "session export-trace": (["session", "export-trace", "session_none", "--url-only"], None),
    }


class CliRefused(Exception):
    pass


def run_command(ctx, main_cli, probes, name, home):
    if name in CLI_NOT_APPLICABLE:
        return "not applicable", CLI_NOT_APPLICABLE[name]
    if name not in probes:
        return "unprobed", "no probe in tests/clients/compat_probe.py"
    args, checker = probes[name]
    code, output, error = invoke(main_cli, args, home, input=os.environ["TINKER_API_KEY"] + "\n")
    if code != 0 and error and getattr(checker, "refusal_expected", False):
        checker.refused()
        return "refused", scrub(error.splitlines()[0])
    if checker is None:
        if code != 0 and error:
            return "refused", scrub(error.splitlines()[0])
        return "broken", scrub(f"expected a refusal: exit {code}: {output[-300:]}")
    if code != 0 or error:
        return "broken", scrub(f"exit {code}: {error or output[-300:]}")
    try:
        return "works", checker(output)
    except CliRefused as refused:
        return "refused", scrub(str(refused))
    except (Broken, ValueError, KeyError) as exc:
        return "broken", scrub(f"{type(exc).__name__}: {exc}")[:300]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model-name", required=True)
    args = parser.parse_args()
    os.environ["TINKER_BASE_URL"] = args.base_url  # the CLI reads it
    ctx = Context(args.base_url, args.model_name)

    def emit(kind, owner, name, result, detail):
        print(json.dumps({"sdk": tinker.__version__, "kind": kind, "class": owner, "name": name, "result": result,
                          "detail": detail}), flush=True)

    for owner, cls in CLASSES.items():
        for name in public_methods(cls):
            emit("method", owner, name, *run_method(ctx, owner, name))
    main_cli, commands = cli_commands()
    with tempfile.TemporaryDirectory() as home:
        probes = cli_probes(ctx, home, os.path.join(home, "downloads"))
        for name in sorted(commands):
            emit("command", "tinker", name, *run_command(ctx, main_cli, probes, name, home))


if __name__ == "__main__":
    main()
