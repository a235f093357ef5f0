"""Measurements shared by save-checkpoint (on the live model) and evaluate-restore
(on the restored one), so both sides are computed the same way."""

from __future__ import annotations

import httpx

from txflow.cluster.handle import ClusterHandle
from txflow.cluster.startup import GREEDY_TOKENS, greedy_answers
from txflow.log import get_logger
from txflow.results import LiveReference
from txflow.training import base_figures, clients, sft


def eval_loss(training_client, examples: list[sft.Example], handle: ClusterHandle, timeout_s: float) -> float:
    """Mean NLL per completion token of `examples` under the client's weights (forward only)."""
    future = training_client.forward([sft.to_datum(e) for e in examples], "cross_entropy")
    output = handle.wait(future, "the evaluation forward pass", timeout_s)
    return sft.mean_nll(output, examples)[0]


def prompt_of(example: sft.Example) -> list[int]:
    tokens, weights = example
    return tokens[: weights.index(1.0)] if 1.0 in weights else tokens


def rollout_examples(prompts: list[list[int]], completions: list[list[int]]) -> list[sft.Example]:
    """Prompt + completion sequences with loss on the completion: a fixed batch to compare losses on."""
    # An empty completion (EOS first) still compares the models on its prompt tokens.
    return [(p + c, [0.0] * len(p) + [1.0] * len(c)) if c else (p, [0.0] + [1.0] * (len(p) - 1))
            for p, c in zip(prompts, completions)]


def greedy_tokens(sampling_client, prompts: list[list[int]], handle: ClusterHandle, timeout_s: float,
                  seed: int) -> list[list[int]]:
    """Greedy continuations of every prompt; all requests in flight together."""
    return [list(r.sequences[0].tokens) for r in greedy_answers(sampling_client, prompts, handle, timeout_s, seed)]


def greedy_and_logprobs(sampling_client, prompts: list[list[int]], handle: ClusterHandle, timeout_s: float,
                        seed: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy continuations of every prompt, and the sampler's logprob of every token after the first of each
    prompt + continuation (the sequence the export reproduces): the prompt's logprobs, then each sampled token's,
    from the same call. Scoring those sequences in a call of their own would sample again; the figures would
    differ only in rounding, and every comparison of them is between two samplers that computed them this way."""
    tokens, logprobs = [], []
    for prompt, response in zip(prompts, greedy_answers(sampling_client, prompts, handle, timeout_s, seed)):
        sequence = response.sequences[0]
        sampled = list(sequence.logprobs or [])
        if len(sampled) != len(sequence.tokens) or any(lp is None for lp in sampled):
            raise RuntimeError(f"the sampler gave {len(sampled)} logprobs for {len(sequence.tokens)} sampled tokens")
        tokens.append(list(sequence.tokens))
        logprobs.append([float(lp) for lp in [*_prompt_logprobs(response, len(prompt)), *sampled]])
    return tokens, logprobs


def _prompt_logprobs(response, length: int) -> list:
    """A response's logprob of every prompt token after the first (`length` tokens in the prompt)."""
    # One per token after the first; an SDK that pads the first position gives it as None.
    given = list(response.prompt_logprobs or [])
    found = given[len(given) - (length - 1):] if length > 1 else []
    if len(found) != length - 1 or any(lp is None for lp in found):
        raise RuntimeError(f"the sampler gave {len(given)} prompt logprobs for a sequence of {length} tokens")
    return found


def sign_flip_p(differences: list[float], samples: int = 200_000) -> float:
    """One-sided p-value that paired differences this far above zero come from chance: the share of the
    2^n sign assignments whose sum is at least the observed sum (exact up to 20 non-zero differences,
    a seeded sample of `samples` assignments beyond)."""
    import itertools
    import random

    values = [abs(d) for d in differences if d != 0]
    observed = sum(d for d in differences if d != 0)
    if not values:
        return 1.0
    if len(values) <= 20:
        signs = itertools.product((1, -1), repeat=len(values))
        hits = sum(sum(s * v for s, v in zip(combo, values)) >= observed - 1e-12 for combo in signs)
        return hits / 2 ** len(values)
    rng = random.Random(0)
    hits = sum(sum(v if rng.random() < 0.5 else -v for v in values) >= observed - 1e-12 for _ in range(samples))
    return (hits + 1) / (samples + 1)


def unload(handle: ClusterHandle, model_id: str) -> None:
    """Free a LoRA adapter slot; SkyRL-tx keeps it until the session times out otherwise."""
    cluster = handle.cluster
    httpx.post(f"{cluster.base_url}/api/v1/unload_model", json={"model_id": model_id, "type": "unload_model"},
               headers={"X-API-Key": cluster.api_key.get_secret_value()}, timeout=30).raise_for_status()


# The base model's greedy tokens of the held-out prompts, as `base_figures` names them: the live reference's, which
# a run's own cluster computes as its readiness sample (`tasks.launch_workers`).
BASE_GREEDY = "greedy_tokens"


def base_greedy_inputs(prompts: list[list[int]], seed: int) -> dict:
    """Everything the base model's greedy tokens of `prompts` depend on besides the model (`base_figures`' key)."""
    return {"prompts": prompts, "seed": seed, "max_tokens": GREEDY_TOKENS}


def eval_prompts(mode: str, data) -> list[list[int]]:
    """Prompts whose greedy continuations compare the live and the restored model."""
    return data.prompts if mode == "rl" else [prompt_of(e) for e in data.eval]


def live_reference(mode: str, handle: ClusterHandle, training_client, data, timeout_s: float,
                   seed: int) -> LiveReference:
    """What `training_client`'s model gives now: its held-out loss, greedy tokens (and the base model's on the
    same prompts, which they must differ from) and the per-token logprobs of each prompt and its greedy tokens.
    Taken at the last step, before the final state is committed, so that every later check compares the durable
    copies with the live model."""
    prompts = eval_prompts(mode, data)
    live_sampler = clients.sampling_client_of(handle, training_client, timeout_s)
    tokens, logprobs = greedy_and_logprobs(live_sampler, prompts, handle, timeout_s, seed)
    base_tokens, shared = base_figures.shared(
        handle, BASE_GREEDY, base_greedy_inputs(prompts, seed),
        lambda: greedy_tokens(handle.base_sampler(timeout_s=timeout_s), prompts, handle, timeout_s, seed))
    if shared:
        get_logger().info("the base model's greedy tokens: another run on this cluster computed them on the same "
                          "prompts")
    examples = data.eval if mode == "sft" else rollout_examples(prompts, tokens)
    return LiveReference(eval_loss=eval_loss(training_client, examples, handle, timeout_s), greedy_tokens=tokens,
                         base_tokens=base_tokens, prompts=prompts, examples=examples, logprobs=logprobs,
                         shared_base_tokens=shared)
