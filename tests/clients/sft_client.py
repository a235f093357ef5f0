"""A Tinker client as an ordinary SDK user writes it; it knows nothing of txflow.

Usage: python sft_client.py --base-url URL --model-name MODEL [--steps N] [--early-save]
The API key comes from TINKER_API_KEY, as the SDK expects.
"""

import argparse

import tinker
from tinker import types


def datum(tokens):
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--early-save", action="store_true", help="also save_state after the first step")
    args = parser.parse_args()

    service = tinker.ServiceClient(base_url=args.base_url)
    training = service.create_lora_training_client(base_model=args.model_name, rank=8)
    batch = [datum([5, 17, 42, 99, 7, 12, 0]), datum([3, 14, 15, 92, 65, 35, 0])]
    for step in range(args.steps):
        fwd = training.forward_backward(batch, "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=1e-2))
        loss = fwd.result().metrics.get("loss:sum")
        opt.result()
        print(f"step {step} loss {loss}", flush=True)
        if args.early_save and step == 0:
            print(f"saved early state {training.save_state('client-early').result().path}", flush=True)
    state = training.save_state("client-state").result().path
    print(f"saved state {state}", flush=True)
    sampler = training.save_weights_for_sampler("client-sampler").result().path
    print(f"saved sampler {sampler}", flush=True)


if __name__ == "__main__":
    main()
