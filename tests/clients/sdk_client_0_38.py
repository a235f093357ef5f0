"""A Tinker client written against the public API of tinker 0.38 (what tinker-cookbook 0.6 requires).

It knows nothing of txflow: it trains a LoRA adapter with SFT steps, saves its state, restores that
state into a new training client and runs a forward pass there, then samples greedily from an
ephemeral sampler and from saved sampler weights; then it trains with each loss of its SDK, with and
without loss_fn_config, with a custom loss (forward_backward_custom), and with LoRA on all but one
module family at a time. In 0.38 the client factories return futures (`.result()`), and the
ServiceClient is a context manager that finishes its session on exit.

Usage: python sdk_client_0_38.py --base-url URL --model-name MODEL [--steps N]
The API key comes from TINKER_API_KEY, as the SDK expects.
"""

import argparse
import json

import tinker
from tinker import types

BATCH = [[5, 17, 42, 99, 7, 12, 0], [3, 14, 15, 92, 65, 35, 0]]
PROMPT = [5, 17, 42]
# The losses of 0.38's LossFnType, with and without loss_fn_config (stable_reinforce is refused, see below).
LOSSES = [("importance_sampling", None), ("ppo", None), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
          ("cispo", None), ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 2.0}), ("dro", {"beta": 0.05}),
          ("gspo", None), ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})]


def datum(tokens):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def mean_nll(output):
    """Mean negative log-likelihood per target token (every weight is 1 here)."""
    logprobs = [lp for out in output.loss_fn_outputs for lp in out["logprobs"].tolist()]
    return -sum(logprobs) / len(logprobs)


def rl_datum(tokens, sampling_logprobs, advantage):
    """An RL datum as the cookbook builds one: a 2-token prompt (logprob 0.0, no advantage), then sampled tokens."""
    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * 2 + sampling_logprobs[2:],
                                       "advantages": [0.0] * 2 + [advantage] * (n - 2),
                                       # gspo's sequence ratio runs over the sampled tokens (0.38's datum key)
                                       "sequence_ratio_mask": [0.0] * 2 + [1.0] * (n - 2)})


def train_with_each_loss(training, batch, losses):
    """One forward_backward + optim_step per (loss, loss_fn_config); prints what came back."""
    live = [out["logprobs"].tolist() for out in training.forward(batch, "cross_entropy").result().loss_fn_outputs]
    data = [rl_datum(BATCH[i], [lp - 0.3 for lp in live[i]], 1.0 if i == 0 else -1.0) for i in range(len(BATCH))]
    for loss_fn, config in losses:
        out = training.forward_backward(data, loss_fn, config).result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        lengths = [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs]
        print(f"loss {loss_fn} {json.dumps(config)} loss:sum {out.metrics['loss:sum']} logprobs {lengths}", flush=True)


def squared_logprobs(data, logprobs_list):
    """A custom loss: the sum of squared logprobs (it falls as the model grows surer of the targets)."""
    loss = sum((logprobs ** 2).sum() for logprobs in logprobs_list)
    return loss, {"squared:sum": float(loss)}


def train_custom(training, batch, steps=3):
    for _ in range(steps):
        out = training.forward_backward_custom(batch, squared_logprobs).result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        print(f"custom loss {out.metrics['squared:sum']} loss:sum {out.metrics['loss:sum']}", flush=True)


def greedy(sampling_client):
    params = types.SamplingParams(max_tokens=4, temperature=0.0, seed=0)
    response = sampling_client.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=1,
                                      sampling_params=params).result()
    return list(response.sequences[0].tokens)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"tinker {tinker.__version__}", flush=True)

    with tinker.ServiceClient(base_url=args.base_url) as service:
        training = service.create_lora_training_client(base_model=args.model_name, rank=8).result()
        print(f"created training client {training.model_id}", flush=True)
        batch = [datum(tokens) for tokens in BATCH]
        for step in range(args.steps):
            # Both requests in flight before either is awaited.
            fwd_bwd = training.forward_backward(batch, "cross_entropy")
            optim = training.optim_step(types.AdamParams(learning_rate=1e-2))
            loss = mean_nll(fwd_bwd.result())
            optim.result()
            print(f"step {step} loss {loss}", flush=True)

        state = training.save_state("sdk-state").result().path
        print(f"saved state {state}", flush=True)
        restored = service.create_training_client_from_state(state).result()
        restored_loss = mean_nll(restored.forward(batch, "cross_entropy").result())
        live_loss = mean_nll(training.forward(batch, "cross_entropy").result())
        print(f"restored forward loss {restored_loss} live forward loss {live_loss}", flush=True)

        ephemeral = training.save_weights_and_get_sampling_client().result()
        print(f"ephemeral sampler tokens {greedy(ephemeral)}", flush=True)
        sampler_path = training.save_weights_for_sampler("sdk-sampler").result().path
        print(f"saved sampler {sampler_path}", flush=True)
        saved = service.create_sampling_client(model_path=sampler_path).result()
        print(f"saved sampler tokens {greedy(saved)}", flush=True)

        train_with_each_loss(training, batch, LOSSES)
        train_custom(training, batch)
        # One module family left out at a time: the saved adapter holds exactly the others.
        for flag in ("train_unembed", "train_mlp", "train_attn"):
            other = service.create_lora_training_client(base_model=args.model_name, rank=8, **{flag: False}).result()
            other.forward_backward(batch, "cross_entropy").result()
            other.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            print(f"without {flag}: saved sampler {other.save_weights_for_sampler(f'no-{flag}').result().path}",
                  flush=True)
        for refused, call in (
                ("nothing to train", lambda: service.create_lora_training_client(
                    base_model=args.model_name, rank=8, train_attn=False, train_mlp=False,
                    train_unembed=False).result()),
                ("stable_reinforce", lambda: training.forward_backward(batch, "stable_reinforce").result())):
            try:
                call()
                print(f"{refused}: accepted", flush=True)
            except Exception as exc:  # the cluster's refusal, as the SDK raises it
                print(f"{refused}: refused: {str(exc).splitlines()[0]}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
