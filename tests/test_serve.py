"""`txflow serve`'s OpenAI side, with the official `openai` client, against a stand-in sampler (no cluster): what
each parameter becomes in the Tinker sample request, what comes back in OpenAI's shapes, and what is refused
in one line. tests/test_shared_cluster_e2e.py and tests/test_cookbook_real_model_e2e.py serve through a real
cluster."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import openai
import pytest
from starlette.testclient import TestClient

from txflow.serving import models, openai_api
from txflow.training.tokenizer import load_tokenizer
from txflow.upstream.tiny_model import resolve_base_model

pytestmark = [pytest.mark.together]

KEY = "sk-test-key"
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


class FakeSampler:
    """Answers each sample with `reply` (token ids) per sample, the k-th sample's last token shifted by k, and
    remembers what it was asked."""

    def __init__(self, reply: list[int], stop_reason: str = "length", fail: Exception | None = None):
        self.reply, self.stop_reason, self.fail, self.calls = reply, stop_reason, fail, []

    def sample(self, prompt, num_samples, sampling_params, include_prompt_logprobs=False):
        tokens = prompt.to_ints()
        self.calls.append({"prompt": tokens, "n": num_samples, "params": sampling_params,
                           "prompt_logprobs": include_prompt_logprobs})
        future = Future()
        if self.fail is not None:
            future.set_exception(self.fail)
            return future
        sequences = [SimpleNamespace(tokens=self.reply[:-1] + [self.reply[-1] + k] if self.reply else [],
                                     logprobs=[-0.5 - k] * len(self.reply), stop_reason=self.stop_reason)
                     for k in range(num_samples)]
        scored = [None] + [-0.1 * i for i in range(1, len(tokens))] if include_prompt_logprobs else None
        future.set_result(SimpleNamespace(sequences=sequences, prompt_logprobs=scored))
        return future


@pytest.fixture(scope="module")
def tokenizer():
    tok = load_tokenizer(resolve_base_model("tiny"))
    tok.chat_template = TEMPLATE
    return tok


def http_of(tokenizer, **samplers) -> TestClient:
    handle = SimpleNamespace(wait=lambda future, what, timeout_s: future.result())
    serving = models.Serving(cfg=None, handle=handle, tokenizer=tokenizer)
    for name, sampler in samplers.items():
        serving.models[name] = models.Served(name, sampler)
    return TestClient(openai_api.app(serving, KEY))


def serve(tokenizer, **samplers) -> tuple[openai.OpenAI, dict]:
    http = http_of(tokenizer, **samplers)
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0), samplers


def words(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_models_lists_every_served_name(tokenizer):
    client, _ = serve(tokenizer, tiny=FakeSampler([5]), mine=FakeSampler([5]))
    assert [m.id for m in client.models.list().data] == ["tiny", "mine"]


def test_a_completion_is_the_samplers_tokens_up_to_the_end_of_sequence(tokenizer):
    reply = words(tokenizer, "a b c")
    eos = tokenizer.eos_token_id
    client, samplers = serve(tokenizer, mine=FakeSampler(reply + [eos, 7]))
    done = client.completions.create(model="mine", prompt="x y", max_tokens=9, temperature=0.0, seed=3, top_p=0.5)
    [call] = samplers["mine"].calls
    assert call["prompt"] == words(tokenizer, "x y") and call["n"] == 1
    params = call["params"]
    assert (params.max_tokens, params.temperature, params.seed, params.top_p, params.stop) == (9, 0.0, 3, 0.5, [eos])
    [choice] = done.choices
    assert choice.text == tokenizer.decode(reply) and choice.finish_reason == "stop"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(call["prompt"]), len(reply))


def test_token_prompts_n_choices_and_the_sampled_tokens_logprobs(tokenizer):
    reply = words(tokenizer, "a b")
    client, samplers = serve(tokenizer, mine=FakeSampler(reply))
    done = client.completions.create(model="mine", prompt=[[1, 2, 3], [4, 5]], n=2, logprobs=1)
    assert [c["prompt"] for c in samplers["mine"].calls] == [[1, 2, 3], [4, 5]]
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    assert [c.finish_reason for c in done.choices] == ["length"] * 4
    assert done.choices[1].logprobs.token_logprobs == [-1.5] * len(reply)  # the second sample of the first prompt
    assert "".join(done.choices[0].logprobs.tokens) == done.choices[0].text
    assert samplers["mine"].calls[0]["params"].max_tokens == openai_api.COMPLETION_MAX_TOKENS


def test_stop_strings_go_to_the_engine_and_the_text_ends_before_them(tokenizer):
    reply = words(tokenizer, "a b c d")
    client, samplers = serve(tokenizer, mine=FakeSampler(reply))
    done = client.completions.create(model="mine", prompt="x", stop=[" c", "zz"])
    assert samplers["mine"].calls[0]["params"].stop == [" c", "zz"]
    assert done.choices[0].text == tokenizer.decode(reply).split(" c")[0] and done.choices[0].finish_reason == "stop"


def test_echo_with_logprobs_scores_the_prompt_as_a_harness_asks(tokenizer):
    """What lm-eval's loglikelihood requests send: echo, logprobs, max_tokens 0: the prompt back with the
    sampler's logprob of each of its tokens (None for the first), nothing continued."""
    prompt = words(tokenizer, "a b c d")
    client, samplers = serve(tokenizer, mine=FakeSampler(words(tokenizer, "x y")))
    done = client.completions.create(model="mine", prompt=prompt, echo=True, logprobs=1, max_tokens=0,
                                     temperature=0)
    [call] = samplers["mine"].calls
    assert call["prompt_logprobs"] and call["params"].max_tokens == 1  # one drawn, not shown
    [choice] = done.choices
    assert choice.text == tokenizer.decode(prompt) and done.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs == [None] + [-0.1 * i for i in range(1, len(prompt))]
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in prompt]
    assert choice.logprobs.top_logprobs[0] is None and len(choice.logprobs.top_logprobs) == len(prompt)
    # Echo with a continuation: the prompt's scores, then the sampled tokens' own.
    both = client.completions.create(model="mine", prompt="a b", echo=True, logprobs=0, max_tokens=2)
    reply = words(tokenizer, "x y")
    assert both.choices[0].text == "a b" + tokenizer.decode(reply)
    assert both.choices[0].logprobs.token_logprobs[-len(reply):] == [-0.5] * len(reply)
    # Echo without logprobs asks the sampler for nothing more.
    client.completions.create(model="mine", prompt="a b", echo=True)
    assert samplers["mine"].calls[-1]["prompt_logprobs"] is False


def test_a_chat_is_rendered_with_the_models_template_and_answered_as_the_assistant(tokenizer):
    reply = words(tokenizer, "b c")
    client, samplers = serve(tokenizer, mine=FakeSampler(reply))
    done = client.chat.completions.create(model="mine", messages=[{"role": "user", "content": "a b"}], logprobs=True)
    assert samplers["mine"].calls[0]["prompt"] == words(tokenizer, "<user>a b<assistant>")
    assert samplers["mine"].calls[0]["params"].max_tokens == openai_api.CHAT_MAX_TOKENS
    message = done.choices[0].message
    assert (message.role, message.content) == ("assistant", tokenizer.decode(reply))
    assert [t.logprob for t in done.choices[0].logprobs.content] == [-0.5] * len(reply)


def test_a_stream_carries_what_the_answer_carries(tokenizer):
    reply = words(tokenizer, "a b c")
    client, _ = serve(tokenizer, mine=FakeSampler(reply))
    whole = client.completions.create(model="mine", prompt="x", n=2, seed=1)
    streamed = {}
    for chunk in client.completions.create(model="mine", prompt="x", n=2, seed=1, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in whole.choices}
    said = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="mine", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert said == tokenizer.decode(reply)


def test_a_wrong_or_missing_key_gets_401_and_nothing_is_sampled(tokenizer):
    client, samplers = serve(tokenizer, mine=FakeSampler([5]))
    stranger = client.with_options(api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model="mine", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()
    http = http_of(tokenizer, mine=samplers["mine"])
    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}):  # none, no scheme, longer
        answer = http.post("/v1/completions", json={"model": "mine", "prompt": "x"}, headers=headers)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    assert samplers["mine"].calls == []


@pytest.mark.parametrize(("call", "error", "says"), [
    ({"model": "other", "prompt": "x"}, openai.NotFoundError, "model 'other' is not served here; served: mine"),
    ({"model": "mine", "prompt": "x", "logprobs": 2}, openai.BadRequestError, "logprobs above 1"),
    ({"model": "mine", "prompt": "x", "presence_penalty": 0.5}, openai.BadRequestError, "presence_penalty is not"),
    ({"model": "mine", "prompt": "x", "max_tokens": 0}, openai.BadRequestError, "max_tokens 0 is for scoring"),
    ({"model": "mine", "prompt": "x", "suffix": "y"}, openai.BadRequestError, "suffix is not supported"),
    ({"model": "mine", "prompt": "x", "best_of": 3}, openai.BadRequestError, "best_of is not supported"),
    ({"model": "mine", "prompt": "x", "max_tokens": -1}, openai.BadRequestError, "max_tokens"),
    ({"model": "mine", "prompt": "x", "temperature": 3}, openai.BadRequestError, "temperature"),
    ({"model": "mine", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, openai.BadRequestError, "stop: up to 4"),
    ({"model": "mine", "prompt": "x", "extra_body": {"guided_json": {}}}, openai.BadRequestError,
     "unknown parameter guided_json"),
])
def test_what_the_sampler_cannot_honour_is_refused_in_one_line(tokenizer, call, error, says):
    client, samplers = serve(tokenizer, mine=FakeSampler([5]))
    with pytest.raises(error) as raised:
        client.completions.create(**call)
    assert says in raised.value.body["message"] and "\n" not in raised.value.body["message"]
    assert samplers["mine"].calls == []


def test_chat_refusals_and_neutral_values_that_pass(tokenizer):
    client, samplers = serve(tokenizer, mine=FakeSampler([5]))
    hello = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="top_logprobs above 0"):
        client.chat.completions.create(model="mine", messages=hello, logprobs=True, top_logprobs=3)
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        client.chat.completions.create(model="mine", messages=hello, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {}}}])
    assert samplers["mine"].calls == []
    client.chat.completions.create(model="mine", messages=hello, presence_penalty=0, frequency_penalty=0)
    assert len(samplers["mine"].calls) == 1


def test_a_model_without_a_chat_template_refuses_chat(tokenizer):
    plain = load_tokenizer(resolve_base_model("tiny"))
    client, _ = serve(plain, tiny=FakeSampler([5]))
    with pytest.raises(openai.BadRequestError, match="has no chat template; use /v1/completions"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])


def test_the_clusters_refusal_is_passed_on(tokenizer):
    client, _ = serve(tokenizer, mine=FakeSampler([5], fail=RuntimeError("400 max_tokens above 4096")))
    with pytest.raises(openai.BadRequestError, match="the cluster refused or failed the sample: 400 max_tokens"):
        client.completions.create(model="mine", prompt="x", max_tokens=5000)


@pytest.mark.parametrize("pair", ["mine", "=url", "a b=url", "a/b=url"])
def test_a_malformed_adapter_is_refused_in_one_line(pair):
    with pytest.raises(ValueError, match="give NAME=URL"):
        models.parse_adapters([pair])
    with pytest.raises(ValueError, match="given twice"):
        models.parse_adapters(["a=x", "a=y"])
