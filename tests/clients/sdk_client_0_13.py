"""A Tinker client written against the public API of tinker 0.13 (the SDK SkyRL-tx 0.3.0 was cut with).
tinker 0.25 has the same public API for everything used here, so its users write the same code.

It knows nothing of txflow: it trains a LoRA adapter with SFT steps, saves its state, restores that
state into a new training client and runs a forward pass there, then samples greedily from an
ephemeral sampler and from saved sampler weights; then it trains with each loss of its SDK, with and
without loss_fn_config, and with a custom loss (forward_backward_custom). In 0.13 the client factories
return clients, and requests return futures.

Usage: python sdk_client_0_13.py --base-url URL --model-name MODEL [--steps N] [--core-only]
The API key comes from TINKER_API_KEY, as the SDK expects.
"""

import argparse
import sys

import tinker
from client_common import BATCH, datum, greedy, mean_nll, train_custom, train_with_each_loss
from tinker import types

# The losses of these SDKs' LossFnType, with and without loss_fn_config.
LOSSES = [("importance_sampling", None), ("ppo", None),
          ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
          ("cispo", None), ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 2.0}), ("dro", {"beta": 0.05})]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--core-only", action="store_true",
                        help="stop after the core calls (train, save, restore, sample): every call a shim serves")
    args = parser.parse_args()
    print(f"tinker {tinker.__version__}", flush=True)

    service = tinker.ServiceClient(base_url=args.base_url)
    training = service.create_lora_training_client(base_model=args.model_name, rank=8)
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
    restored = service.create_training_client_from_state(state)
    restored_loss = mean_nll(restored.forward(batch, "cross_entropy").result())
    live_loss = mean_nll(training.forward(batch, "cross_entropy").result())
    print(f"restored forward loss {restored_loss} live forward loss {live_loss}", flush=True)

    print(f"ephemeral sampler tokens {greedy(training.save_weights_and_get_sampling_client())}", flush=True)
    sampler_path = training.save_weights_for_sampler("sdk-sampler").result().path
    print(f"saved sampler {sampler_path}", flush=True)
    print(f"saved sampler tokens {greedy(service.create_sampling_client(model_path=sampler_path))}", flush=True)

    if not args.core_only:
        train_with_each_loss(training, batch, LOSSES)
        train_custom(restored, batch)
    # The cluster's handshake turns the SDK's pyqwest transport off; the SDK imports pyqwest only to use it.
    print(f"http transport {'pyqwest' if 'pyqwest' in sys.modules else 'httpx'}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
