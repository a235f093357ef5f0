"""SFT examples (txflow.training.sft) on the real tiny tokenizer, and JSONL datasets (txflow.training.datasets)."""

from __future__ import annotations

import json
import math
import random
import uuid

import fsspec
import pytest

from txflow.training import datasets, sft
from txflow.training.datasets import REQUIRED_KEYS, DatasetError, bundled_dataset, load_jsonl

pytestmark = [pytest.mark.together]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from txflow.upstream.tiny_model import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model())


ROW = {"prompt": "English: one\nFrench:", "completion": " un\n"}


def rows(n: int) -> list[dict]:
    return [{"prompt": f"English: {i}\nFrench:", "completion": f" {i}\n"} for i in range(n)]


# --- encode ----------------------------------------------------------------------


def test_encode_weights_prompt_tokens_zero_and_completion_plus_eos_one(tokenizer):
    tokens, weights = sft.encode(ROW, tokenizer, max_len=512, where="test")
    prompt = tokenizer.encode(ROW["prompt"], add_special_tokens=False)
    completion = tokenizer.encode(ROW["completion"], add_special_tokens=False)
    assert prompt and completion
    assert tokens == prompt + completion + [tokenizer.eos_token_id]
    assert weights == [0.0] * len(prompt) + [1.0] * (len(completion) + 1)


def test_encode_of_a_row_that_exactly_fits_the_context_succeeds(tokenizer):
    tokens, _ = sft.encode(ROW, tokenizer, max_len=512, where="test")
    assert sft.encode(ROW, tokenizer, max_len=len(tokens), where="test")[0] == tokens


def test_encode_of_a_row_longer_than_the_context_names_where(tokenizer):
    tokens, _ = sft.encode(ROW, tokenizer, max_len=512, where="test")
    with pytest.raises(ValueError, match=r"^data\.jsonl line 7: .*longer than the model's context of") as info:
        sft.encode(ROW, tokenizer, max_len=len(tokens) - 1, where="data.jsonl line 7")
    assert f"{len(tokens)} tokens" in str(info.value)


# --- encode with a chat template (the real SmolLM2 tokenizer) -------------------------


@pytest.fixture(scope="module", params=["tokenizers", "transformers"])
def smollm2(request):
    """SmolLM2-135M-Instruct's tokenizer, as pre-flight loads it (tokenizers) and as transformers does."""
    from txflow.config import SMOLLM2_MODEL
    from txflow.training.tokenizer import load_tokenizer
    from txflow.upstream.tiny_model import resolve_base_model

    path = resolve_base_model(SMOLLM2_MODEL)  # converted once into the cache (~40 s), then read
    if request.param == "tokenizers":
        return load_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def decoded(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_a_chat_model_sees_the_prompt_as_a_user_turn_weighted_zero(smollm2):
    tokens, weights = sft.encode({"prompt": "What is 12 + 7?", "completion": "19"}, smollm2, 8192, "test")
    prompt = [t for t, w in zip(tokens, weights) if w == 0.0]
    assert prompt == tokens[: len(prompt)]  # prompt first, then only completion tokens
    assert decoded(smollm2, prompt) == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                                        "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n"
                                        "<|im_start|>assistant\n")


def test_a_chat_model_learns_the_reply_and_its_end_of_turn_weighted_one(smollm2):
    tokens, weights = sft.encode({"prompt": "What is 12 + 7?", "completion": "19"}, smollm2, 8192, "test")
    completion = [t for t, w in zip(tokens, weights) if w == 1.0]
    assert weights == [0.0] * (len(tokens) - len(completion)) + [1.0] * len(completion)
    assert decoded(smollm2, completion) == "19<|im_end|>"
    assert completion[-1] == smollm2.eos_token_id == 2


def test_a_chat_model_is_asked_rl_prompts_as_the_user_and_answers_as_the_assistant(smollm2):
    from txflow.training import rl
    from txflow.training.rewards import exact_answer

    data = rl.prepare([{"prompt": "What is 12 + 7?", "answer": "19"}], smollm2, 8192, 8, "test", exact_answer,
                      "txflow.training.rewards:exact_answer")
    [prompt] = data.prompts
    assert decoded(smollm2, prompt).endswith("<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n")
    # The same tokens SFT puts before the reply: what RL samples after is what SFT trained.
    tokens, weights = sft.encode({"prompt": "What is 12 + 7?", "completion": "19"}, smollm2, 8192, "test")
    assert prompt == [t for t, w in zip(tokens, weights) if w == 0.0]


def test_an_rl_rows_few_shot_prefix_comes_before_its_prompt(smollm2):
    from txflow.training import rl
    from txflow.training.rewards import exact_answer

    prefix = [{"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"}]
    data = rl.prepare([{"prompt": "What is 12 + 7?", "answer": "19", "convo_prefix": prefix}], smollm2, 8192, 8,
                      "test", exact_answer, "txflow.training.rewards:exact_answer")
    assert decoded(smollm2, data.prompts[0]).endswith(
        "<|im_start|>user\nWhat is 4 + 5?<|im_end|>\n<|im_start|>assistant\n9<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("prefix", [{"role": "user"}, [{"role": "user"}], ["hi"], [{"role": 1, "content": "x"}]])
def test_a_malformed_few_shot_prefix_names_its_line(smollm2, prefix):
    from txflow.training import rl
    from txflow.training.rewards import exact_answer

    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "x", "answer": "1", "convo_prefix": prefix}]
    with pytest.raises(ValueError, match=r"data.jsonl line 2: convo_prefix must be a list of chat messages"):
        rl.prepare(rows, smollm2, 8192, 8, "data.jsonl", exact_answer, "txflow.training.rewards:exact_answer")


def test_the_chat_rendering_is_transformers_own(smollm2):
    from transformers import AutoTokenizer

    from txflow.config import SMOLLM2_MODEL
    from txflow.training.tokenizer import render_chat
    from txflow.upstream.tiny_model import resolve_base_model

    reference = AutoTokenizer.from_pretrained(resolve_base_model(SMOLLM2_MODEL))
    chat = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi"}]
    for messages, generation_prompt in ((chat[:1], True), (chat, False)):
        assert render_chat(smollm2, messages, generation_prompt) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt)


CONVERSATION = {"messages": [{"role": "system", "content": "Answer with the number only."},
                             {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"},
                             {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6"}]}


def test_a_conversation_is_the_chat_templates_tokens_with_loss_on_every_assistant_reply(smollm2):
    from transformers import AutoTokenizer

    from txflow.config import SMOLLM2_MODEL
    from txflow.upstream.tiny_model import resolve_base_model

    tokens, weights = sft.encode(CONVERSATION, smollm2, 8192, "test")
    reference = AutoTokenizer.from_pretrained(resolve_base_model(SMOLLM2_MODEL))
    rendered = reference.apply_chat_template(CONVERSATION["messages"], tokenize=False)
    # The template's own text, up to the last reply's end of turn (its trailing newline opens no turn to learn).
    assert decoded(smollm2, tokens) == rendered[: rendered.rindex("<|im_end|>") + len("<|im_end|>")]
    trained = [t for t, w in zip(tokens, weights) if w == 1.0]
    assert decoded(smollm2, trained) == "4<|im_end|>6<|im_end|>"  # each reply through its end of turn
    assert set(weights) == {0.0, 1.0}
    runs = [w for i, w in enumerate(weights) if i == 0 or w != weights[i - 1]]
    assert runs == [0.0, 1.0, 0.0, 1.0]  # system + user, reply, (newline) user, reply


def test_a_prompt_completion_row_is_the_two_message_conversation(smollm2):
    row = {"prompt": "What is 12 + 7?", "completion": "19"}
    as_messages = {"messages": [{"role": "user", "content": row["prompt"]},
                                {"role": "assistant", "content": row["completion"]}]}
    assert sft.encode(row, smollm2, 8192, "test") == sft.encode(as_messages, smollm2, 8192, "test")


def test_a_conversation_needs_a_chat_template(tokenizer):
    with pytest.raises(ValueError, match=r"^c\.jsonl line 2: a messages row needs a model with a chat template"):
        sft.encode(CONVERSATION, tokenizer, 512, "c.jsonl line 2")


@pytest.mark.parametrize(("messages", "says"), [
    ([], "'messages' must be a non-empty list"),
    ("hi", "'messages' must be a non-empty list"),
    ([{"role": "user", "content": "hi"}], "has no assistant message to train on"),
    ([{"role": "assistant", "content": "hi"}], "opens with an assistant message"),
    ([{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}], "message 1 must be {\"role\""),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}], "message 1 must be"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "message 2 must be"),
])
def test_a_malformed_conversation_names_its_line_and_what_is_wrong(tmp_path, messages, says):
    url = tmp_path / "conversations.jsonl"
    url.write_text(json.dumps(CONVERSATION) + "\n" + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(DatasetError, match=r"conversations\.jsonl line 2: ") as info:
        load_jsonl(str(url), REQUIRED_KEYS["sft"], messages=True)
    assert says in str(info.value)


def test_conversations_and_prompt_completion_rows_mix_in_one_sft_dataset(tmp_path):
    url = tmp_path / "mixed.jsonl"
    url.write_text(json.dumps(CONVERSATION) + "\n" + json.dumps(ROW) + "\n")
    assert load_jsonl(str(url), REQUIRED_KEYS["sft"], messages=True) == [CONVERSATION, ROW]
    with pytest.raises(DatasetError, match="line 1: needs a non-empty string field 'prompt'"):
        load_jsonl(str(url), REQUIRED_KEYS["rl"])  # rl reads prompts only


def test_the_tiny_model_has_no_chat_template_and_keeps_its_plain_rendering(tokenizer):
    from txflow.training.tokenizer import chat_template

    assert chat_template(tokenizer) is None


# --- prepare -----------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 9, 10, 19, 25, 40])
def test_prepare_holds_out_the_last_tenth_at_least_one(tokenizer, n):
    data = sft.prepare(rows(n), tokenizer, 512, "mem.jsonl")
    held_out = max(1, n // 10)
    expected = [sft.encode(r, tokenizer, 512, "") for r in rows(n)]
    assert data.train == expected[: n - held_out]
    assert data.eval == expected[n - held_out :]


def test_prepare_of_a_single_row_trains_and_evaluates_on_it(tokenizer):
    data = sft.prepare([ROW], tokenizer, 512, "one.jsonl")
    assert len(data.train) == 1 and data.eval == data.train


def test_an_eval_dataset_is_held_out_instead_of_the_last_tenth_and_every_row_trains(tokenizer):
    held = [{"prompt": "English: ten\nFrench:", "completion": " dix\n", "answer": "dix"}]
    data = sft.prepare(rows(20), tokenizer, 512, "train.jsonl", held, "eval.jsonl")
    assert data.train == [sft.encode(r, tokenizer, 512, "") for r in rows(20)]
    assert data.eval == [sft.encode(held[0], tokenizer, 512, "")] and data.eval_rows == held


def test_a_conversations_held_out_row_shows_the_message_its_answers_continue(smollm2):
    data = sft.prepare([CONVERSATION] * 3, smollm2, 8192, "c.jsonl", [{**CONVERSATION, "answer": "4"}], "e.jsonl")
    assert data.eval_rows == [{"prompt": "What is 2 + 2?", "answer": "4"}]
    # The greedy answers continue the conversation up to its first reply (evaluation.prompt_of).
    from txflow.training.evaluation import prompt_of

    assert decoded(smollm2, prompt_of(data.eval[0])).endswith("What is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")


def test_prepare_names_the_line_of_an_eval_row_that_is_too_long(tokenizer):
    with pytest.raises(ValueError, match=r"^eval\.jsonl line 1: "):
        sft.prepare(rows(5), tokenizer, 512, "ds.jsonl", [{"prompt": "E:", "completion": " deux" * 400}], "eval.jsonl")


def test_prepare_names_the_line_of_a_row_that_is_too_long(tokenizer):
    data = rows(5)
    data[3] = {"prompt": "English:", "completion": " deux" * 400}
    with pytest.raises(ValueError, match=r"^ds\.jsonl line 4: "):
        sft.prepare(data, tokenizer, 512, "ds.jsonl")


# --- batch_indices -------------------------------------------------------------------


def test_batch_indices_are_the_same_for_the_same_step_and_seed():
    """A retry, in a fresh process, must see the batches the first attempt saw: the indices depend on
    (examples, step, batch size, seed) only, never on the process's own random state."""
    random.seed(12345)
    random.random()
    assert datasets.batch_indices(37, 5, 4, seed=3) == [30, 25, 18, 29]
    assert datasets.batch_indices(37, 9, 4, seed=3) == [27, 24, 35, 34]  # the second epoch, reshuffled


@pytest.mark.parametrize(("num_examples", "batch_size"), [(10, 5), (10, 4), (7, 3), (36, 4), (3, 8)])
def test_batch_indices_cover_each_example_once_per_epoch(num_examples, batch_size):
    epochs = 3
    steps = math.ceil(num_examples * epochs / batch_size)
    flat = [i for step in range(steps) for i in datasets.batch_indices(num_examples, step, batch_size, seed=1)]
    assert all(len(datasets.batch_indices(num_examples, s, batch_size, 1)) == batch_size for s in range(steps))
    for epoch in range(epochs):
        assert sorted(flat[epoch * num_examples : (epoch + 1) * num_examples]) == list(range(num_examples))


def test_batch_indices_differ_between_seeds():
    def order(seed):
        return [i for step in range(10) for i in datasets.batch_indices(40, step, 4, seed)]

    assert order(0) != order(1)
    assert sorted(order(0)) == sorted(order(1)) == list(range(40))


def test_batch_indices_reshuffle_each_epoch():
    first = [i for step in range(10) for i in datasets.batch_indices(40, step, 4, seed=0)]
    second = [i for step in range(10, 20) for i in datasets.batch_indices(40, step, 4, seed=0)]
    assert first != second


# --- to_datum, mean_nll ---------------------------------------------------------------


def test_to_datum_predicts_each_next_token():
    datum = sft.to_datum(([11, 12, 13, 14], [0.0, 0.0, 1.0, 1.0]))
    assert datum.model_input.to_ints() == [11, 12, 13]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [12, 13, 14]
    # Tinker sums the loss: each completion token weighs 1 / (completion tokens), a mean per sequence.
    assert datum.loss_fn_inputs["weights"].tolist() == [0.0, 0.5, 0.5]


class _Logprobs:
    def __init__(self, values):
        self.values = values

    def tolist(self):
        return list(self.values)


class _Output:
    def __init__(self, per_example):
        self.loss_fn_outputs = [{"logprobs": _Logprobs(v)} for v in per_example]


def test_mean_nll_is_the_weighted_mean_over_completion_tokens():
    examples = [([1, 2, 3, 4], [0.0, 0.0, 1.0, 1.0]), ([5, 6, 7], [0.0, 1.0, 1.0])]
    # logprobs align with targets tokens[1:], weights[1:]: the prompt target (-9.0) carries no loss.
    output = _Output([[-9.0, -1.0, -2.0], [-0.5, -1.5]])
    nll, tokens = sft.mean_nll(output, examples)
    assert tokens == 4
    assert nll == pytest.approx((1.0 + 2.0 + 0.5 + 1.5) / 4)


def test_mean_nll_without_completion_tokens_is_zero():
    assert sft.mean_nll(_Output([[-3.0]]), [([1, 2], [0.0, 0.0])]) == (0.0, 0)


# --- load_jsonl ----------------------------------------------------------------------


def write(tmp_path, text: str):
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    return str(path)


GOOD = json.dumps({"prompt": "p", "completion": "c"})


@pytest.mark.parametrize(
    ("lines", "line_no", "says"),
    [
        ([GOOD, GOOD, '{"prompt": "p", "completion": '], 3, "not valid JSON"),
        (['{"prompt": "p"', GOOD], 1, "not valid JSON"),
        ([GOOD, "", "{oops}"], 3, "not valid JSON"),  # blank lines still count
        ([GOOD, '["prompt", "c"]'], 2, "expected a JSON object, got list"),
        ([GOOD, GOOD, GOOD, '"just a string"'], 4, "expected a JSON object, got str"),
        ([GOOD, '{"prompt": "p"}'], 2, "'completion'"),
        ([GOOD, '{"prompt": "", "completion": "c"}'], 2, "'prompt'"),
        ([GOOD, '{"prompt": 3, "completion": "c"}'], 2, "'prompt'"),
    ],
)
def test_load_jsonl_names_the_line_of_a_bad_row(tmp_path, lines, line_no, says):
    url = write(tmp_path, "\n".join(lines) + "\n")
    with pytest.raises(DatasetError) as info:
        load_jsonl(url, REQUIRED_KEYS["sft"])
    message = str(info.value)
    assert message.startswith(f"{url} line {line_no}: ")
    assert says in message


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_load_jsonl_of_an_empty_file_says_no_rows(tmp_path, text):
    with pytest.raises(DatasetError, match="has no rows"):
        load_jsonl(write(tmp_path, text), ("prompt",))


def test_load_jsonl_of_a_missing_file_says_it_does_not_exist(tmp_path):
    url = str(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match=f"Dataset {url} does not exist"):
        load_jsonl(url, ("prompt",))


def test_load_jsonl_reads_any_fsspec_url():
    url = f"memory://txflow-test-{uuid.uuid4().hex}/data.jsonl"
    fs = fsspec.filesystem("memory")
    try:
        fs.pipe_file(url, (GOOD + "\n\n" + json.dumps({"prompt": "q", "completion": "d", "extra": 1}) + "\n").encode())
        assert load_jsonl(url, REQUIRED_KEYS["sft"]) == [
            {"prompt": "p", "completion": "c"},
            {"prompt": "q", "completion": "d", "extra": 1},
        ]
    finally:
        fs.rm(url.rsplit("/", 1)[0], recursive=True)


def test_load_jsonl_of_a_missing_memory_url_says_it_does_not_exist():
    url = f"memory://txflow-test-{uuid.uuid4().hex}/nope.jsonl"
    with pytest.raises(DatasetError, match="does not exist"):
        load_jsonl(url, ("prompt",))


@pytest.mark.parametrize(("mode", "keys"), [("sft", ("prompt", "completion")), ("rl", ("prompt",))])
def test_bundled_datasets_load_with_their_required_keys(mode, keys):
    assert REQUIRED_KEYS[mode] == keys
    loaded = load_jsonl(bundled_dataset(mode), keys)
    assert len(loaded) >= 10
    assert all(isinstance(row[key], str) and row[key] for row in loaded for key in keys)


def test_bundled_sft_dataset_fits_the_tiny_model(tokenizer):
    data = sft.prepare(load_jsonl(bundled_dataset("sft"), REQUIRED_KEYS["sft"]), tokenizer, 512, "bundled")
    assert len(data.train) >= 1 and len(data.eval) >= 1
