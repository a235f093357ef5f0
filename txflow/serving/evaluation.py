"""Evaluations with a real harness: Inspect (`inspect-ai`) runs a task against txflow's OpenAI-compatible
endpoint, once per served model (the base model and each adapter), through its OpenAI-compatible provider, as
it would against any OpenAI server. What a run measures itself (its held-out loss, accuracy and reward) stays
in its report; this is the same model judged by a harness others use too, its logs kept for `inspect view`.

A task is a JSONL file of `{"prompt": ..., "answer": ...}` rows (an optional `convo_prefix` of chat messages
before the prompt, as the bundled RL task has): each prompt is a user turn, the model answers it greedily, and
Inspect's `match(numeric=True)` scores the number in the answer against `answer`. `arithmetic` is the bundled
held-out set (`txflow/data/arithmetic_rl.jsonl`)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from txflow.training.datasets import bundled_dataset, load_jsonl

ARITHMETIC = "arithmetic"
SERVICE = "txflow"  # Inspect's provider `openai-api/<service>/<model>`: any OpenAI-compatible server


@dataclass
class Score:
    """One model's result on the task, from Inspect's own log."""

    model: str
    accuracy: float
    samples: int
    log: str


def task_rows(task: str, options: dict | None = None) -> tuple[str, list[dict]]:
    """The task's name and rows: `arithmetic` (bundled) or a JSONL file (any fsspec URL) of prompts and answers;
    ValueError in one line when a row lacks either."""
    url = bundled_dataset("rl", "smollm2-135m") if task == ARITHMETIC else task
    name = ARITHMETIC if task == ARITHMETIC else Path(task).stem
    return name, load_jsonl(url, ("prompt", "answer"), options or {})


def inspect_task(name: str, rows: list[dict]):
    """The rows as an Inspect task: a chat per row, answered by `generate`, scored by `match(numeric=True)`."""
    from inspect_ai import Task
    from inspect_ai.dataset import MemoryDataset, Sample
    from inspect_ai.model import ChatMessageAssistant, ChatMessageSystem, ChatMessageUser
    from inspect_ai.scorer import match
    from inspect_ai.solver import generate

    kinds = {"system": ChatMessageSystem, "user": ChatMessageUser, "assistant": ChatMessageAssistant}
    samples = [Sample(input=[kinds[m["role"]](content=m["content"]) for m in row.get("convo_prefix", [])]
                      + [ChatMessageUser(content=row["prompt"])], target=str(row["answer"]), id=i + 1)
               for i, row in enumerate(rows)]
    return Task(dataset=MemoryDataset(samples, name=name), solver=generate(), scorer=match(numeric=True),
                name=name)


def run(base_url: str, api_key: str, models: list[str], task: tuple[str, list[dict]], log_dir: str,
        limit: int | None, max_tokens: int) -> list[Score]:
    """Inspect's evaluation of `task` (`task_rows`) for each of `models` on the endpoint at `base_url`, greedy,
    each model's log under `log_dir`; RuntimeError naming the model when Inspect's run does not succeed."""
    from inspect_ai import eval as inspect_eval
    from inspect_ai.model import GenerateConfig, get_model

    name, rows = task
    scores = []
    for model in models:
        [log] = inspect_eval(inspect_task(name, rows),
                             model=get_model(f"openai-api/{SERVICE}/{model}", base_url=base_url, api_key=api_key,
                                             config=GenerateConfig(temperature=0.0, max_tokens=max_tokens)),
                             log_dir=log_dir, limit=limit, display="none", log_format="json", max_retries=0)
        if log.status != "success" or log.results is None:
            error = log.error.message if log.error is not None else log.status
            raise RuntimeError(f"Inspect's evaluation of {model} on {name} did not finish: {error}")
        accuracy = log.results.scores[0].metrics["accuracy"].value
        scores.append(Score(model=model, accuracy=float(accuracy), samples=log.results.completed_samples,
                            log=log.location))
    return scores


def report(task: str, scores: list[Score]) -> dict:
    """What `txflow eval --json` prints and writes beside the logs (eval.json)."""
    return {"task": task, "harness": "inspect_ai", "scores": [asdict(s) for s in scores]}


def table(report_: dict) -> str:
    """The scores side by side, for a terminal."""
    lines = [f"{report_['task']} (Inspect, match numeric): model, accuracy, samples"]
    lines += [f"  {s['model']}: {s['accuracy']:.1%} of {s['samples']}" for s in report_["scores"]]
    return "\n".join(lines)


@contextlib.contextmanager
def endpoint(serving, api_key: str, host: str = "127.0.0.1"):
    """`txflow serve`'s endpoint over `serving` on a free port of `host`, in a thread of this process, for as
    long as the block runs; yields its base URL (`.../v1`)."""
    import uvicorn

    from txflow.serving import openai_api

    sock = socket.create_server((host, 0))
    server = uvicorn.Server(uvicorn.Config(openai_api.app(serving, api_key), log_level="warning"))
    server.install_signal_handlers = lambda: None  # the command's own handlers stay (only the main thread may)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="txflow-eval-endpoint",
                              daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the evaluation's endpoint did not start")
            threading.Event().wait(0.05)
        yield f"http://{host}:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def write(report_: dict, log_dir: str) -> str:
    """eval.json beside Inspect's logs; its path."""
    path = Path(log_dir) / "eval.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report_, indent=2))
    return str(path)


def evaluate_run(cfg, handle, saved) -> dict:
    """The flow's evaluate step, on the run's own cluster while it is up: its committed sampler checkpoint in a
    slot of its own (as `txflow serve` loads an adapter) beside the base model, both served on the endpoint and
    scored by Inspect on `cfg.eval_task`; the logs under `<run root>/eval/`. The report's `evaluation`."""
    import secrets

    from txflow.log import get_logger, register_secret
    from txflow.serving.models import Served, Serving
    from txflow.training import evaluation as engine
    from txflow.training.restore import restored_sampler
    from txflow.training.tokenizer import load_tokenizer

    task = task_rows(cfg.eval_task, cfg.plain_storage_options())
    client = handle.service_client()
    sampler_url = next(c.url for c in saved.checkpoints if c.kind == "sampler")
    sampler, slot = restored_sampler(cfg, handle, client, sampler_url, cfg.lora_rank)
    try:
        serving = Serving(cfg=cfg, handle=handle, tokenizer=load_tokenizer(handle.cluster.base_model_path),
                          timeout_s=cfg.step_timeout_s)
        serving.models[cfg.base_model] = Served(cfg.base_model, handle.base_sampler(client))
        serving.models[cfg.run_id] = Served(cfg.run_id, sampler)
        api_key = "sk-txflow-" + secrets.token_hex(16)
        register_secret(api_key)
        with endpoint(serving, api_key) as base_url:
            scores = run(base_url, api_key, [cfg.base_model, cfg.run_id], task, f"{cfg.run_root}/eval", None, 16)
    finally:
        engine.unload(handle, slot.model_id)
    result = report(task[0], scores)
    get_logger().info("evaluate: " + table(result).replace("\n", ";"))
    return result
