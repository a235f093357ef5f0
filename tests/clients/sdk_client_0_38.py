"""A Tinker client written against the public API of tinker 0.38 (what tinker-cookbook 0.6 requires).

It knows nothing of txflow: it trains a LoRA adapter with SFT steps, saves its state, restores that
state into a new training client and runs a forward pass there, then samples greedily from an
ephemeral sampler and from saved sampler weights; then it trains with each loss of its SDK, with and
without loss_fn_config, with a custom loss (forward_backward_custom), and with LoRA on all but one
module family at a time. In 0.38 the client factories return futures (`.result()`), and the
ServiceClient is a context manager that finishes its session on exit.

Usage: python sdk_client_0_38.py --base-url URL --model-name MODEL [--steps N] [--core-only]
The API key comes from TINKER_API_KEY, as the SDK expects.
"""

import argparse
import os
import sys

import httpx
import tinker
from client_common import BATCH, datum, greedy, mean_nll, train_custom, train_with_each_loss
from tinker import types

# The losses of 0.38's LossFnType, with and without loss_fn_config (stable_reinforce is refused, see below).
LOSSES = [("importance_sampling", None), ("ppo", None),
          ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
          ("cispo", None), ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 2.0}), ("dro", {"beta": 0.05}),
          ("gspo", None), ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--core-only", action="store_true",
                        help="stop after the core calls (train, save, restore, sample): every call a shim serves")
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

        if not args.core_only:
            beyond_the_core(service, training, restored, batch, args.model_name, args.base_url)
    # The cluster's handshake turns the SDK's pyqwest transport off; the SDK imports pyqwest only to use it.
    print(f"http transport {'pyqwest' if 'pyqwest' in sys.modules else 'httpx'}", flush=True)
    print("done", flush=True)


def beyond_the_core(service, training, restored, batch, model_name, base_url):
    """Each loss, a custom loss, the LoRA flags, and what the cluster refuses."""
    train_with_each_loss(training, batch, LOSSES, ratio_mask=True)
    train_custom(restored, batch)
    # One module family left out at a time: the saved adapter holds exactly the others.
    for flag in ("train_unembed", "train_mlp", "train_attn"):
        other = service.create_lora_training_client(base_model=model_name, rank=8, **{flag: False}).result()
        other.forward_backward(batch, "cross_entropy").result()
        other.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        print(f"without {flag}: saved sampler {other.save_weights_for_sampler(f'no-{flag}').result().path}",
              flush=True)
    try:
        training.forward_backward(batch, "stable_reinforce").result()
        print("stable_reinforce: accepted", flush=True)
    except Exception as exc:  # the cluster's refusal, as the SDK raises it
        print(f"stable_reinforce: refused: {str(exc).splitlines()[0]}", flush=True)
    # Every SDK refuses an adapter with nothing to train before sending it; another client may send it.
    empty = {"rank": 8, "train_attn": False, "train_mlp": False, "train_unembed": False}
    answer = httpx.post(f"{base_url}/api/v1/create_model", timeout=60,
                        headers={"X-API-Key": os.environ["TINKER_API_KEY"]},
                        json={"session_id": "raw-client", "base_model": model_name, "lora_config": empty})
    print(f"nothing to train: {'refused' if answer.status_code == 400 else 'accepted'}: "
          f"{answer.json().get('detail')}", flush=True)


if __name__ == "__main__":
    main()
