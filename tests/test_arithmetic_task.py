"""The bundled arithmetic task: its data is what its generator writes, every answer is right, and the
exact-answer reward scores a completion by its first number."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from txflow.training import datasets
from txflow.training.rewards import close_answer, exact_answer, first_number

REPO = Path(__file__).resolve().parents[1]


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (REPO / "txflow" / "data" / name).read_text().splitlines()]


def test_every_bundled_answer_is_the_arithmetic_of_its_prompt():
    sft, rl = rows("arithmetic_sft.jsonl"), rows("arithmetic_rl.jsonl")
    assert (len(sft), len(rl)) == (320, 24)
    for row in sft + rl:
        expression = row["prompt"].removeprefix("What is ").split("?")[0]
        assert int(row["answer"]) == eval(expression, {"__builtins__": {}}), row  # digits and + - * only
    assert all(row["completion"] == row["answer"] for row in sft)
    assert not {r["prompt"] for r in sft} & {r["prompt"] for r in rl}  # RL prompts are not trained on by SFT


def test_the_committed_data_is_what_the_generator_writes(tmp_path):
    before = {name: (REPO / "txflow" / "data" / name).read_bytes() for name in ("arithmetic_sft.jsonl",
                                                                                 "arithmetic_rl.jsonl")}
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_arithmetic_data.py")], check=True,
                   capture_output=True)
    after = {name: (REPO / "txflow" / "data" / name).read_bytes() for name in before}
    assert after == before


def test_the_bundled_files_load_as_datasets_of_their_mode():
    for name, mode, count in (("arithmetic_sft.jsonl", "sft", 320), ("arithmetic_rl.jsonl", "rl", 24)):
        assert len(datasets.load_jsonl(str(REPO / "txflow" / "data" / name), datasets.REQUIRED_KEYS[mode])) == count


@pytest.mark.parametrize(("completion", "reward"), [
    ("19", 1.0), (" 19<|im_end|>", 1.0), ("The answer is 19.", 1.0), ("19 + 1 = 20", 1.0),
    ("9", 0.0), ("190", 0.0), ("12 + 7 = 19", 0.0), ("", 0.0), ("nineteen", 0.0), ("-19", 0.0)])
def test_the_reward_is_one_exactly_when_the_first_number_is_the_answer(completion, reward):
    assert exact_answer("What is 12 + 7?", completion, [], {"answer": "19"}) == reward


def test_negative_and_grouped_numbers():
    assert first_number("-12 apples") == -12 and first_number("1,024") == 1024 and first_number("none") is None
    assert exact_answer("What is 3 - 15?", "-12", [], {"answer": "-12"}) == 1.0


def test_every_rl_prompt_comes_after_one_solved_example():
    for row in rows("arithmetic_rl.jsonl"):
        user, assistant = row["convo_prefix"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        expression = user["content"].removeprefix("What is ").split("?")[0]
        assert int(assistant["content"]) == eval(expression, {"__builtins__": {}})


@pytest.mark.parametrize(("completion", "reward"), [
    ("19", 1.0), (" 19.", 1.0), ("19<|im_end|>", 0.0), ("18", 0.25 + 0.25 * (1 - 1 / 19)),
    ("20 apples", 0.25 + 0.25 * (1 - 1 / 19)), ("29", 0.25 + 0.25 * (1 - 10 / 19)), ("38", 0.25), ("-5", 0.25),
    ("The answer is 19.", 0.0), ("", 0.0), ("nineteen", 0.0)])
def test_the_close_answer_reward_reads_the_first_word_one_for_the_answer_at_most_half_near(completion, reward):
    assert close_answer("What is 12 + 7?", completion, [], {"answer": "19"}) == pytest.approx(reward)
    assert close_answer("What is 7 - 7?", "1", [], {"answer": "0"}) == 0.25  # an answer of 0: a miss by 1 is far
