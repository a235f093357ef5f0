"""`txflow eval`'s harness side: Inspect (its OpenAI-compatible provider) against txflow's endpoint over HTTP, with
stand-in samplers (no cluster): one answers every arithmetic question right, one always says 0; the scores are
what Inspect's own logs say. tests/test_cookbook_real_model_e2e.py evaluates a trained SmolLM2 adapter through a
real cluster."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from tests.test_serve import TEMPLATE
from txflow.serving import evaluation, models
from txflow.training.tokenizer import load_tokenizer
from txflow.upstream.tiny_model import resolve_base_model

KEY = "sk-eval-test"


class Calculator:
    """Answers the last `What is A op B?` of the prompt: right, or always `0`."""

    def __init__(self, tokenizer, right: bool):
        self.tokenizer, self.right = tokenizer, right

    def sample(self, prompt, num_samples, sampling_params, include_prompt_logprobs=False):
        a, op, b = re.findall(r"What is (\d+) ([-+*]) (\d+)\?", self.tokenizer.decode(prompt.to_ints()))[-1]
        answer = str(eval(f"{a}{op}{b}")) if self.right else "0"  # noqa: S307 (two numbers and an operator)
        tokens = self.tokenizer.encode(answer, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        future = Future()
        future.set_result(SimpleNamespace(sequences=[SimpleNamespace(tokens=tokens, logprobs=[-0.1] * len(tokens),
                                                                     stop_reason="stop")] * num_samples,
                                          prompt_logprobs=None))
        return future


@pytest.fixture
def serving():
    tokenizer = load_tokenizer(resolve_base_model("tiny"))
    tokenizer.chat_template = TEMPLATE
    handle = SimpleNamespace(wait=lambda future, what, timeout_s: future.result())
    serving = models.Serving(cfg=None, handle=handle, tokenizer=tokenizer)
    serving.models["base"] = models.Served("base", Calculator(tokenizer, right=False))
    serving.models["trained"] = models.Served("trained", Calculator(tokenizer, right=True))
    return serving


def test_inspect_scores_each_served_model_through_the_endpoint_and_keeps_its_logs(serving, tmp_path):
    name, rows = task = evaluation.task_rows(evaluation.ARITHMETIC)
    with evaluation.endpoint(serving, KEY) as base_url:
        scores = evaluation.run(base_url, KEY, ["base", "trained"], task, str(tmp_path / "logs"), limit=6,
                                max_tokens=8)
    report = evaluation.report(name, scores)
    by_model = {s["model"]: s for s in report["scores"]}
    assert by_model["trained"]["accuracy"] == 1.0 and by_model["base"]["accuracy"] == 0.0
    assert [s["samples"] for s in report["scores"]] == [6, 6]
    # Inspect's own log of each model: its samples, its answers, its score.
    for model, expected in (("base", "0"), ("trained", None)):
        log = json.loads(open(by_model[model]["log"]).read())
        assert log["eval"]["model"] == f"openai-api/txflow/{model}" and len(log["samples"]) == 6
        answers = [s["output"]["completion"] for s in log["samples"]]
        assert answers == [expected or str(rows[i]["answer"]) for i in range(6)], answers
        assert [s["scores"]["match"]["value"] for s in log["samples"]] == ["I" if expected else "C"] * 6
    path = evaluation.write(report, str(tmp_path / "logs"))
    assert json.loads(open(path).read()) == report


def test_a_wrong_key_is_a_failed_evaluation_naming_the_model(serving, tmp_path):
    with evaluation.endpoint(serving, KEY) as base_url:
        with pytest.raises(RuntimeError, match="Inspect's evaluation of base on arithmetic did not finish"):
            evaluation.run(base_url, "sk-not-this", ["base"], evaluation.task_rows(evaluation.ARITHMETIC),
                           str(tmp_path), limit=1, max_tokens=8)


@pytest.mark.parametrize("argv, message", [
    (["--task", "/no/such/task.jsonl"], "does not exist"),
    (["--adapter", "no-equals-sign"], "--adapter 'no-equals-sign': give NAME=URL"),
    (["--limit", "0"], "--limit 0: at least 1 sample"),
    ([], "--cluster nowhere: no such cluster"),
])
def test_bad_input_is_one_line_and_exit_code_2_before_anything_is_loaded(argv, message, tmp_path, monkeypatch,
                                                                         capsys):
    from txflow import cli

    monkeypatch.setenv("TXFLOW_CLUSTERS_DIR", str(tmp_path / "clusters"))
    assert cli.main(["eval", "--cluster", "nowhere", "--log-dir", str(tmp_path / "logs"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("txflow: ") and message in err[0], err
    assert not (tmp_path / "logs").exists()
