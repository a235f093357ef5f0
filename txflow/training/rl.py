"""Reinforcement learning: sample groups with the current policy, score them,
and update with group-relative advantages (importance sampling or PPO)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from txflow.training.rewards import RewardFn, score
from txflow.training.tokenizer import chat_template, render_chat

# tinker is imported where requests are built: it imports torch (~4 s), and pre-flight must stay fast.


@dataclass
class RLData:
    rows: list[dict]
    prompts: list[list[int]]
    tokenizer: object
    reward: RewardFn
    reward_spec: str
    url: str


@dataclass
class Rollout:
    row: int
    tokens: list[int]
    logprobs: list[float]
    reward: float


def prepare(rows: list[dict], tokenizer, max_len: int, max_tokens: int, url: str, reward: RewardFn,
            reward_spec: str) -> RLData:
    """Tokenize prompts; each must leave room for `max_tokens` sampled tokens in the context. A model with a
    chat template sees each prompt as a user turn followed by the template's generation prompt, as the SFT
    rows are rendered (`sft.encode`): the policy answers as the assistant."""
    prompts = []
    for i, row in enumerate(rows):
        text = row["prompt"]
        # A row's `convo_prefix` (chat messages before its prompt: a few-shot example, as the cookbook's
        # arithmetic environment adds) goes before the user turn.
        prefix = row.get("convo_prefix") or []
        if not isinstance(prefix, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in prefix):
            raise ValueError(f"{url} line {i + 1}: convo_prefix must be a list of chat messages, each an object "
                             f"with string fields 'role' and 'content'")
        if chat_template(tokenizer) is not None:
            text = render_chat(tokenizer, [*prefix, {"role": "user", "content": text}], add_generation_prompt=True)
        elif prefix:
            text = "\n".join([*(m["content"] for m in prefix), text])
        tokens = tokenizer.encode(text, add_special_tokens=False)
        if len(tokens) + max_tokens > max_len:
            raise ValueError(f"{url} line {i + 1}: prompt of {len(tokens)} tokens plus {max_tokens} sampled "
                             f"tokens exceeds the model's context of {max_len}")
        prompts.append(tokens)
    return RLData(rows=rows, prompts=prompts, tokenizer=tokenizer, reward=reward, reward_spec=reward_spec, url=url)


def sample_groups(sampling_client, data: RLData, indices: list[int], group_size: int, max_tokens: int,
                  temperature: float, seed: int, handle, timeout_s: float) -> list[list[Rollout]]:
    """`group_size` completions per prompt, scored; every request is in flight before any is awaited."""
    from txflow.upstream.tinker_sdk import tinker

    futures = [sampling_client.sample(prompt=tinker.types.ModelInput.from_ints(data.prompts[i]),
                                      num_samples=group_size,
                                      sampling_params=tinker.types.SamplingParams(
                                          max_tokens=max_tokens, temperature=temperature,
                                          seed=request_seed(seed, i, group_size)))
               for i in indices]
    groups = []
    for i, future in zip(indices, futures):
        response = handle.wait(future, "a rollout sample", timeout_s)
        group = []
        for seq in response.sequences:
            tokens = list(seq.tokens)
            text = data.tokenizer.decode(tokens, skip_special_tokens=True)
            reward = score(data.reward, data.reward_spec, data.rows[i]["prompt"], text, tokens, data.rows[i],
                           f"{data.url} line {i + 1}")
            logprobs = list(seq.logprobs or [])
            if len(logprobs) != len(tokens):
                # Importance ratios need the sampler's own logprob of every sampled token; a stand-in
                # would train on a wrong ratio without a word.
                raise RuntimeError(f"the sampler returned {len(logprobs)} logprobs for {len(tokens)} sampled tokens "
                                   f"({data.url} line {i + 1}); the importance ratio cannot be computed")
            group.append(Rollout(row=i, tokens=tokens, logprobs=logprobs, reward=reward))
        groups.append(group)
    return groups


def request_seed(seed: int, row: int, group_size: int) -> int:
    """A seed per (call, prompt). SkyRL-tx gives sample k of a request `seed + k`; with one seed for
    every prompt, a tiny model draws near-identical completions for all prompts of a batch."""
    return (seed * 7919 + row * max(group_size, 1)) % (2**31 - 1024)


def to_datums(groups: list[list[Rollout]], data: RLData) -> list:
    """One datum per rollout; advantage = reward minus the mean reward of its group. The weights, 1 / (sampled
    tokens), make each rollout count its mean loss per token (see `sft.averaged`)."""
    from txflow.upstream.tinker_sdk import tinker

    datums = []
    for group in groups:
        mean = statistics.fmean(r.reward for r in group)
        for r in group:
            if not r.tokens:
                continue
            prompt = data.prompts[r.row]
            tokens = prompt + r.tokens
            n_prompt = len(prompt) - 1  # targets start at the second token
            datums.append(tinker.types.Datum(
                model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "weights": [0.0] * n_prompt + [1.0 / len(r.tokens)] * len(r.tokens),
                    "logprobs": [0.0] * n_prompt + r.logprobs,
                    "advantages": [0.0] * n_prompt + [r.reward - mean] * len(r.tokens),
                },
            ))
    return datums


def minibatches(datums: list, substeps: int) -> list[list]:
    """The datums, in group order, as `min(substeps, len)` contiguous minibatches of nearly equal size:
    one optimizer step each (the cookbook's substeps). The old policy of every minibatch is the sampler's."""
    n = min(substeps, len(datums))
    bounds = [round(i * len(datums) / n) for i in range(n + 1)]
    return [datums[a:b] for a, b in zip(bounds, bounds[1:])]


def clip_fraction(datums: list, outputs: list, low: float, high: float) -> tuple[int, int]:
    """(clipped, counted) action tokens of a PPO update: the ratio r = exp(new - old logprob) is clipped
    where it moved past its thresholds in the direction its advantage pushes (A > 0 and r > high, or
    A < 0 and r < low). `outputs` are forward_backward's per-datum outputs (new logprobs)."""
    clipped = counted = 0
    for datum, output in zip(datums, outputs):
        inputs = datum.loss_fn_inputs
        new = output["logprobs"].tolist()
        for weight, old, advantage, now in zip(inputs["weights"].tolist(), inputs["logprobs"].tolist(),
                                               inputs["advantages"].tolist(), new):
            if weight <= 0 or advantage == 0:
                continue
            counted += 1
            ratio = math.exp(now - old)
            clipped += (advantage > 0 and ratio > high) or (advantage < 0 and ratio < low)
    return clipped, counted


def rewards_of(groups: list[list[Rollout]]) -> list[float]:
    return [r.reward for group in groups for r in group]
