"""What the SDK clients of tests/clients do alike on 0.13, 0.25 and 0.38 (the same public API for these calls).

Imported by the client scripts from their own folder (the folder of a script run as `python script.py`
is on its path); it knows nothing of txflow.
"""

import json

from tinker import types

BATCH = [[5, 17, 42, 99, 7, 12, 0], [3, 14, 15, 92, 65, 35, 0]]
PROMPT = [5, 17, 42]


def datum(tokens):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def mean_nll(output):
    """Mean negative log-likelihood per target token (every weight is 1 here)."""
    logprobs = [lp for out in output.loss_fn_outputs for lp in out["logprobs"].tolist()]
    return -sum(logprobs) / len(logprobs)


def rl_datum(tokens, sampling_logprobs, advantage, ratio_mask=False):
    """An RL datum as the cookbook builds one: a 2-token prompt (logprob 0.0, no advantage), then sampled tokens;
    with `ratio_mask`, gspo's sequence_ratio_mask over the sampled tokens (a datum key since 0.38)."""
    n = len(tokens) - 1
    inputs = {"target_tokens": tokens[1:], "logprobs": [0.0] * 2 + sampling_logprobs[2:],
              "advantages": [0.0] * 2 + [advantage] * (n - 2)}
    if ratio_mask:
        inputs["sequence_ratio_mask"] = [0.0] * 2 + [1.0] * (n - 2)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def train_with_each_loss(training, batch, losses, ratio_mask=False):
    """One forward_backward + optim_step per (loss, loss_fn_config); prints what came back."""
    live = [out["logprobs"].tolist() for out in training.forward(batch, "cross_entropy").result().loss_fn_outputs]
    data = [rl_datum(BATCH[i], [lp - 0.3 for lp in live[i]], 1.0 if i == 0 else -1.0, ratio_mask)
            for i in range(len(BATCH))]
    for loss_fn, config in losses:
        out = training.forward_backward(data, loss_fn, config).result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        lengths = [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs]
        print(f"loss {loss_fn} {json.dumps(config)} loss:sum {out.metrics['loss:sum']} logprobs {lengths}", flush=True)


def squared_logprobs(data, logprobs_list):
    """A custom loss: the sum of squared logprobs (it falls as the model grows surer of the targets)."""
    loss = sum((logprobs ** 2).sum() for logprobs in logprobs_list)
    return loss, {"squared:sum": float(loss.detach())}


def train_custom(training, batch, steps=3):
    """A few steps of the custom loss. Give it a client whose optimizer starts afresh (one restored from state
    without its optimizer): momentum another loss left in Adam's moments can carry a step uphill."""
    for _ in range(steps):
        out = training.forward_backward_custom(batch, squared_logprobs).result()
        # Small steps: Adam moves every LoRA weight by about the rate at once, and this loss is steep (the sum of
        # squared logprobs rose 78 -> 603 at 2e-3 from a fresh optimizer once).
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        print(f"custom loss {out.metrics['squared:sum']} loss:sum {out.metrics['loss:sum']}", flush=True)


def greedy(sampling_client):
    params = types.SamplingParams(max_tokens=4, temperature=0.0, seed=0)
    response = sampling_client.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=1,
                                      sampling_params=params).result()
    return list(response.sequences[0].tokens)
