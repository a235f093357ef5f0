"""Tinker clients on the real chat model, SmolLM2-135M-Instruct, all on one warm cluster of it (`txflow cluster up`,
one process) with a key from `txflow cluster key`, as a user's notebook would hold one:
- the tinker-cookbook's recipes `chat_sl` and `math_rl` (arithmetic), unchanged and with the SDK's LoRA defaults
  (the unembedding of a tied model included), through `txflow run custom --cluster`, with the cookbook renderer
  that writes SmolLM2's ChatML chat template (their tiny-model runs: tests/test_sdk_matrix_e2e.py);
- a client written for another Tinker server, knowing the model by its hub id or txflow's name, offline;
- txflow's own SFT on conversations with an eval dataset, attached to the cluster (`--cluster`).
One cluster instead of one per test: each started cluster cost 25-45 s here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import alive_pids, new_prefect_home, run_txflow, txflow_cmd
from tests.sdk_envs import sdk_env
from tests.test_sdk_matrix_e2e import COOKBOOK_ENV, COOKBOOK_STEPS
from txflow.config import NAMED_MODELS, SMOLLM2_MODEL
from txflow.processes.ports import free_port

CLIENTS = Path(__file__).parent / "clients"
NAME = "smollm2"

pytestmark = [pytest.mark.e2e, pytest.mark.together, pytest.mark.heavy(1)]


@pytest.fixture(scope="module")
def warm(tmp_path_factory, prefect_db):
    """A warm SmolLM2 cluster and a key of its own for the clients (what `eval "$(txflow cluster key ...)"`
    exports), offline: Hugging Face reads only local files, and https goes to a closed port on loopback."""
    from txflow.cluster.launchers import stop_cluster

    work = tmp_path_factory.mktemp("smollm2")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(new_prefect_home(work / "prefect-home", prefect_db)), DO_NOT_TRACK="1",
               TINKER_TELEMETRY="0", PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1",
               TXFLOW_CLUSTERS_DIR=str(work / "clusters"), HF_HUB_OFFLINE="1",
               https_proxy=f"http://127.0.0.1:{free_port()}", no_proxy="127.0.0.1,localhost")
    log = work / "up.log"
    holder = subprocess.Popen(txflow_cmd("cluster", "up", NAME, "--base-model", SMOLLM2_MODEL, "--processes", "1",
                                         "--lora-adapters", "8"), env=env, cwd=work, stdout=subprocess.DEVNULL,
                              stderr=open(log, "w"))
    try:
        serves_file = work / "clusters" / NAME / "serves.json"
        deadline = time.monotonic() + 600
        while not (serves_file.exists() and json.loads(serves_file.read_text())["state"] == "up"):
            assert holder.poll() is None, f"cluster up exited {holder.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"cluster not up in 600 s: {log.read_text()[-3000:]}"
            time.sleep(0.2)
        issued = run_txflow(["cluster", "key", NAME, "--label", "clients", "--ttl", "2h"], env, work, timeout=60)
        assert issued.returncode == 0, issued.stderr
        exported = dict(line.removeprefix("export ").split("=", 1) for line in issued.stdout.splitlines())
        yield {"env": env, "work": work, "exported": exported, "serves": json.loads(serves_file.read_text())}
    finally:
        run_txflow(["cluster", "down", NAME], env, work, timeout=60)
        if holder.poll() is None:
            holder.kill()
        holder.wait(timeout=30)
        stop_cluster(work / "clusters" / NAME, grace_s=1.0)
    assert alive_pids(work / "clusters" / NAME) == []


def run_client(warm, name: str, command: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """A client process with the warm cluster's exported key and URL; its output in `<work>/<name>.log`."""
    done = subprocess.run(command, env=warm["env"] | warm["exported"], cwd=warm["work"], capture_output=True,
                          text=True, timeout=timeout)
    (warm["work"] / f"{name}.log").write_text(done.stdout + done.stderr)
    return done


# SmolLM2's template is ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`) with a default system prompt when a
# conversation has none; the cookbook's `qwen3_instruct` renderer writes the same ChatML, without a default
# system prompt and ending a trained turn at `<|im_end|>` (its stop token). With a system message its tokens are
# the template's (checked below).
RENDERER = "qwen3_instruct"
SYSTEM = {"role": "system", "content": "You translate English numbers to French."}
CONVERSATIONS = [("one", "un"), ("two", "deux"), ("three", "trois"), ("four", "quatre")]

RENDERER_CHECK = f"""
import json, sys
from transformers import AutoTokenizer
from tinker_cookbook import renderers
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
renderer = renderers.get_renderer({RENDERER!r}, tokenizer)
conversation = json.loads(sys.argv[2])
def template(messages, **kw):
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)
supervised, _ = renderer.build_supervised_example(conversation)
print(json.dumps({{"supervised": supervised.to_ints(), "template": template(conversation),
                  "prompt": renderer.build_generation_prompt(conversation[:-1]).to_ints(),
                  "template_prompt": template(conversation[:-1], add_generation_prompt=True),
                  "stop": renderer.get_stop_sequences(), "im_end": tokenizer.convert_tokens_to_ids("<|im_end|>"),
                  "newline": tokenizer.encode("\\n")}}))
"""


def smollm2_path() -> str:
    from txflow.upstream.tiny_model import resolve_base_model

    return resolve_base_model(SMOLLM2_MODEL)


def test_the_renderer_writes_smollm2s_chat_template():
    python = sdk_env("0.38.0", COOKBOOK_STEPS, name=COOKBOOK_ENV) / "bin" / "python"
    conversation = [SYSTEM, {"role": "user", "content": "one"}, {"role": "assistant", "content": "un"}]
    done = subprocess.run([str(python), "-c", RENDERER_CHECK, smollm2_path(), json.dumps(conversation)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["prompt"] == got["template_prompt"]  # what the model is sampled from
    # What it trains on: the template's tokens, up to the turn's <|im_end|> (the template adds a newline).
    assert got["supervised"] + got["newline"] == got["template"]
    assert got["stop"] == [got["im_end"]]


# The recipes never pass the LoRA flags, so they ask for the SDK's default train_unembed=True on a model that ties
# its head to its embedding: SkyRL-tx 0.3.0 refuses that; txflow trains the shared matrix's LoRA (the `tied-head-lora`
# change).


def run_recipe(warm, run_id: str, module: str, *options: str, export: bool = True) -> tuple[dict, str, Path]:
    """`txflow run custom --cluster` with a cookbook recipe, unchanged, in the cookbook's environment, attached to
    the warm SmolLM2 cluster: (the report, the client's log, its log_path)."""
    python = sdk_env("0.38.0", COOKBOOK_STEPS, name=COOKBOOK_ENV) / "bin" / "python"
    work = warm["work"]
    log_path = work / f"{run_id}-log"
    result = run_txflow(["run", "custom", "--base-model", SMOLLM2_MODEL, "--cluster", NAME, "--run-id", run_id,
                         "--state-dir", str(work / run_id), "--checkpoints", str(work / "ckpt"), "--client", module,
                         "--client-python", str(python), "--client-arg=base_url={base_url}",
                         "--client-arg=model_name={base_model}", f"--client-arg=renderer_name={RENDERER}",
                         f"--client-arg=log_path={log_path}", *[f"--client-arg={option}" for option in options],
                         "--json", *([] if export else ["--no-export"])], warm["env"], work, timeout=1500)
    client_log = work / run_id / "logs" / "client.log"
    log = client_log.read_text() if client_log.exists() else ""
    assert result.returncode == 0, result.stderr[-3000:] + "\n--- client.log ---\n" + log[-3000:]
    report = json.loads(result.stdout)
    # Every checkpoint the recipe saved, committed and verified; the last sampler exported and proven against
    # SkyRL-tx's own float32 forward, the unembedding (the tied matrix's LoRA, at both ends) included.
    assert report["status"] == "passed" and report["restore"]["passed"]
    assert all(check["passed"] for check in report["restore"]["checks"])
    if export:
        block = report["export"]
        assert block["passed"] and block["greedy_tokens_match"]
        assert block["max_abs_logprob_diff"] <= block["logprob_bound"]
        assert {"embed_tokens", "lm_head"} <= set(block["target_modules"])
        # The proof's reference is SkyRL-tx's float32 forward of the checkpoint (this run's nightly proof too:
        # test_real_model_e2e runs the nightly's configs without the export).
        assert block["compared_against"].startswith("SkyRL-tx's forward of the checkpoint in float32 (the cluster "
                                                    "computed in bfloat16)")
        assert block["cluster_mean_abs_logprob_diff"] < 0.5  # bfloat16's noise, reported (measured 0.08-0.13)
    else:
        assert not report["export"]
    return report, log, log_path


def test_the_cookbook_supervised_trainer_trains_smollm2_with_its_defaults(warm):
    data = warm["work"] / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": [SYSTEM, {"role": "user", "content": q},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for q, a in CONVERSATIONS))
    _, log, log_path = run_recipe(warm, "cookbook-sl", "tinker_cookbook.recipes.chat_sl.train", f"dataset={data}",
                                  "batch_size=2", "max_length=128", "lora_rank=8", "learning_rate=0.0005")
    assert "Training completed successfully" in log
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1] and all(math.isfinite(m["train_mean_nll"]) for m in metrics)


def test_the_cookbook_rl_recipe_trains_smollm2_with_its_defaults(warm):
    _, _, log_path = run_recipe(warm, "cookbook-rl", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic",
                                "loss_fn=cispo", "groups_per_batch=4", "group_size=4", "max_tokens=5", "max_steps=2",
                                "lora_rank=8", "learning_rate=0.0001", "eval_every=0",
                                export=False)  # the tied head's export is proven by the supervised recipe's run
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "env/all/reward/total" in m]
    assert len(steps) == 2 and all(math.isfinite(m["env/all/reward/total"]) for m in steps), metrics


def test_a_client_that_knows_the_model_by_its_hub_id_or_txflows_name_trains_offline(warm):
    """A client written for another Tinker server checks the served names, trains with each name of SmolLM2 and
    loads its tokenizer through the SDK (training client, and a sampler of its saved weights) with no network;
    another model is refused in one line."""
    hub_id = NAMED_MODELS[SMOLLM2_MODEL].hf_id
    done = run_client(warm, "names", [str(sdk_env("0.38.0") / "bin" / "python"), str(CLIENTS / "names_client.py"),
                                      hub_id, SMOLLM2_MODEL])
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-3000:]
    served = next(line for line in log.splitlines() if line.startswith("served ["))
    assert f"['{hub_id}', '{SMOLLM2_MODEL}', " in served  # the hub id first: the most portable name
    # Each name trained, and get_info answers with the name the client passed.
    assert f"trained {hub_id}: get_info names {hub_id}, loss" in log
    assert f"trained {SMOLLM2_MODEL}: get_info names {SMOLLM2_MODEL}, loss" in log
    refused = next(line for line in log.splitlines() if line.startswith("refused HuggingFaceTB/SmolLM2-360M"))
    assert "is not served by this cluster; it serves" in refused and hub_id in refused


def test_sft_on_conversations_with_an_eval_dataset_trains_the_real_model_and_chats_through_txflow_serve(
        tmp_path, warm, reaper):
    """txflow's own SFT on `{"messages": [...]}` rows (a system prompt, a question, the reply) rendered with
    SmolLM2's chat template, evaluated on a separate `--eval-dataset` of conversations, attached to the warm
    cluster: the held-out loss falls and the report shows the eval rows' questions with both models' answers.
    Then `txflow serve` serves the adapter, and the `openai` client chats with it: its answer is the sampler's
    greedy continuation of the conversation as the model's chat template renders it."""
    from txflow.serving import evaluation
    from txflow.training.datasets import bundled_dataset

    arithmetic = [json.loads(line) for line in open(bundled_dataset("sft", SMOLLM2_MODEL))]

    def conversation(row: dict) -> dict:
        return {"messages": [{"role": "system", "content": "You are a calculator."},
                             {"role": "user", "content": row["prompt"]},
                             {"role": "assistant", "content": row["completion"]}], "answer": row["answer"]}

    train, held, task = tmp_path / "train.jsonl", tmp_path / "held.jsonl", tmp_path / "sums.jsonl"
    # The evaluate step's task: four questions of the bundled arithmetic set (each answer Inspect asks for costs
    # seconds of sampling here), as a file of prompts and answers.
    task.write_text("".join(json.dumps(row) + "\n" for row in evaluation.task_rows(evaluation.ARITHMETIC)[1][:4]))
    train.write_text("".join(json.dumps(conversation(r)) + "\n" for r in arithmetic[:64]))
    held.write_text("".join(json.dumps(conversation(r)) + "\n" for r in arithmetic[-6:]))
    state = reaper.watch(tmp_path / "state")
    tracked = f"sqlite:///{tmp_path / 'mlflow.db'}"  # the run and its evaluation, side by side in MLflow
    result = run_txflow(["run", "sft", "--base-model", SMOLLM2_MODEL, "--run-id", "chat", "--state-dir", str(state),
                         "--checkpoints", str(tmp_path / "ckpt"), "--dataset", str(train), "--eval-dataset", str(held),
                         "--steps", "4", "--cluster", NAME, "--no-export", "--json", "--tracking-uri", tracked,
                         "--eval", str(task)],
                        warm["env"], tmp_path, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["status"] == "passed" and report["eval_dataset"] == str(held)
    restore = report["restore"]
    assert restore["passed"] and restore["eval_loss_gain"] > 0.05
    # The answers are the held-out conversations' questions, not rows of the training set.
    assert [a["prompt"] for a in restore["answers"]] == [r["prompt"] for r in arithmetic[-6:]]
    assert [a["expected"] for a in restore["answers"]] == [r["answer"] for r in arithmetic[-6:]]
    assert report["cluster"]["ranks"] == []  # attached: it started and stopped nothing (the fixture checks the rest)
    # The flow's evaluate step: Inspect scored the base model and the adapter on the task, every question of it,
    # its logs under the run root.
    scored = report["evaluation"]
    assert (scored["task"], scored["harness"]) == ("sums", "inspect_ai")
    assert [(s["model"], s["samples"]) for s in scored["scores"]] == [(SMOLLM2_MODEL, 4), ("chat", 4)]
    assert all(Path(s["log"]).parent == Path(report["checkpoint_root"]) / "eval" for s in scored["scores"])
    chat_through_serve(warm, report["checkpoint_root"], conversation(arithmetic[-1])["messages"][:-1])
    evaluate_with_inspect(warm, report["checkpoint_root"], tmp_path / "evals", tracked)


def evaluate_with_inspect(warm, root: str, log_dir: Path, tracked: str) -> None:
    """`txflow eval`: Inspect scores the base model and the adapter on the bundled arithmetic task through the
    endpoint, each model's score in the report and in Inspect's own log beside it, and in MLflow: a run of its
    own, and on the adapter's training run beside its metrics."""
    from mlflow.tracking import MlflowClient

    result = run_txflow(["eval", "--cluster", NAME, "--adapter", f"calc={root}", "--limit", "4", "--max-tokens", "8",
                         "--log-dir", str(log_dir), "--tracking-uri", tracked, "--json"], warm["env"], warm["work"],
                        timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["task"] == "arithmetic" and report["harness"] == "inspect_ai"
    assert [s["model"] for s in report["scores"]] == [SMOLLM2_MODEL, "calc"]
    assert json.loads((log_dir / "eval.json").read_text()) == report
    for score in report["scores"]:
        log = json.loads(Path(score["log"]).read_text())  # Inspect's own, under --log-dir
        assert Path(score["log"]).parent == log_dir and log["eval"]["model"] == f"openai-api/txflow/{score['model']}"
        right = [s["scores"]["match"]["value"] == "C" for s in log["samples"]]
        assert len(right) == score["samples"] == 4 and score["accuracy"] == pytest.approx(sum(right) / 4)
    base, calc = (s["accuracy"] for s in report["scores"])
    client = MlflowClient(tracking_uri=tracked)
    runs = {r.info.run_name: r for r in client.search_runs(client.get_experiment_by_name("txflow").experiment_id)}
    assert set(runs) == {"chat", "eval arithmetic"}
    assert runs["eval arithmetic"].data.metrics == {f"eval/arithmetic/{SMOLLM2_MODEL}/accuracy": base,
                                                    "eval/arithmetic/calc/accuracy": calc}
    trained = runs["chat"]
    history = {key: [m.value for m in client.get_metric_history(trained.info.run_id, key)]
               for key in ("eval/arithmetic/accuracy", "eval/arithmetic/base_accuracy")}
    assert calc in history["eval/arithmetic/accuracy"] and base in history["eval/arithmetic/base_accuracy"]
    assert "nll" in trained.data.metrics  # beside the run's own per-step metrics


# A rounding step of a bfloat16 logit between 16 and 32 (a logprob's step is the logit's).
BF16_STEP = 0.125


def scored(client, tokens: list[int]) -> list[float]:
    """The served model's logprob of each token of `tokens` after the first (`echo`, nothing continued)."""
    done = client.completions.create(model="calc", prompt=tokens, max_tokens=0, echo=True, logprobs=0)
    return done.choices[0].logprobs.token_logprobs[1:]


def chat_through_serve(warm, root: str, messages: list[dict]) -> None:
    import openai

    from txflow.checkpoints import export
    from txflow.training.tokenizer import load_tokenizer, render_chat

    reference = export.read_reference(root, {})
    tokenizer = load_tokenizer(reference.base_model)
    with open(warm["work"] / "serve.log", "w") as log:
        server = subprocess.Popen(txflow_cmd("serve", "--cluster", NAME, "--adapter", f"calc={root}", "--port", "0"),
                                  env=warm["env"], cwd=warm["work"], stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        exported = dict(server.stdout.readline().strip().removeprefix("export ").split("=", 1) for _ in range(2))
        assert set(exported) == {"OPENAI_BASE_URL", "OPENAI_API_KEY"}, (warm["work"] / "serve.log").read_text()
        client = openai.OpenAI(base_url=exported["OPENAI_BASE_URL"], api_key=exported["OPENAI_API_KEY"],
                               max_retries=0)
        assert [m.id for m in client.models.list().data] == [SMOLLM2_MODEL, "calc"]
        # The served model is the run's adapter: its logprobs of the reference sequences are the ones the restored
        # sampler recorded (measured: equal; the base model's differ by 3.6-8.4), up to rounding: a served request
        # carries a stop token the evaluation's do not, and the model runs in bfloat16, where the same weights in
        # another program can round a logit a step (0.125 for a logit between 16 and 32) apart.
        for sequence, recorded in zip(reference.sequences[:2], reference.logprobs[:2]):
            got = scored(client, sequence)
            assert max(abs(a - b) for a, b in zip(got, recorded)) <= 2 * BF16_STEP, (got, recorded)
        # Its greedy continuation of the run's reference prompts is the one evaluate-restore recorded, up to a tie.
        # A request without prompt logprobs is sampled by the prefill-once program (`prefill-once-per-prompt`),
        # which rounds otherwise in bfloat16: where two tokens share the top logit, it can order them otherwise.
        eos = tokenizer.eos_token_id
        for prompt, greedy in zip(reference.prompts[:2], reference.greedy_tokens[:2]):
            want = greedy[:greedy.index(eos)] if eos in greedy else greedy
            done = client.completions.create(model="calc", prompt=prompt, max_tokens=len(greedy), temperature=0,
                                             logprobs=0)
            pieces = done.choices[0].logprobs.tokens
            if done.choices[0].text != tokenizer.decode(want):
                at = next(i for i, token in enumerate(greedy)
                          if i >= len(pieces) or pieces[i] != tokenizer.decode([token]))
                chosen = (done.choices[0].logprobs.token_logprobs[at] if at < len(pieces)
                          else scored(client, prompt + greedy[:at] + [eos])[-1])  # it stopped: end of sequence
                recorded = scored(client, prompt + greedy[:at + 1])[-1]
                assert abs(chosen - recorded) <= 2 * BF16_STEP, (
                    f"served {pieces} against the recorded {greedy}: token {at} is no tie ({chosen}, {recorded})")
        # A chat is that conversation rendered with the template, continued greedily up to the end of the turn.
        rendered = tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt=True))
        chat = client.chat.completions.create(model="calc", messages=messages, temperature=0, max_tokens=8)
        plain = client.completions.create(model="calc", prompt=rendered, temperature=0, max_tokens=8)
        assert chat.choices[0].message.content == plain.choices[0].text and plain.choices[0].text.strip()
        assert chat.usage.prompt_tokens == len(rendered)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="calc", messages=messages, temperature=0, max_tokens=8, stream=True))
        assert streamed == chat.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="sk-not-this-one").chat.completions.create(model="calc", messages=messages)
        server.terminate()
        assert server.wait(timeout=60) == 0, (warm["work"] / "serve.log").read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(timeout=30)
