"""A client written for another Tinker server: it asks which models the server serves, passes a name it knows
the model by (its Hugging Face id, or txflow's name), and loads the tokenizer through the SDK. It knows nothing
of txflow and runs offline (HF_HUB_OFFLINE=1).

Usage: python names_client.py NAME [NAME ...]   (TINKER_BASE_URL and TINKER_API_KEY from the environment)
Each NAME trains one step; the last one's adapter is saved. A model the cluster does not serve is refused.
"""

import sys

import tinker
from tinker import types

UNSERVED = "HuggingFaceTB/SmolLM2-360M-Instruct"


def datum(tokenizer) -> types.Datum:
    tokens = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"},
                                            {"role": "assistant", "content": "4"}], tokenize=True)
    tokens = list(tokens["input_ids"] if hasattr(tokens, "keys") else tokens)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def main() -> None:
    service = tinker.ServiceClient()
    served = [m.model_name for m in tinker.RestClient().get_server_capabilities().result().supported_models]
    print(f"served {served}", flush=True)
    for name in sys.argv[1:]:
        assert name in served, f"{name} not in {served}"
        training = service.create_lora_training_client(base_model=name, rank=8, train_unembed=False).result()
        tokenizer = training.get_tokenizer()
        # The base model sampled by this name (SDK 0.38 loads a base sampler's tokenizer by the name itself,
        # client-side: the training client's, which asks the server, is the one that works offline).
        base = service.create_sampling_client(base_model=name).result()
        prompt = types.ModelInput.from_ints(tokenizer.encode("What is 2 + 2?"))
        sample = base.sample(prompt, 1, types.SamplingParams(max_tokens=2, temperature=0.0)).result()
        assert len(sample.sequences[0].tokens) == 2
        loss = training.forward_backward([datum(tokenizer)], "cross_entropy").result().metrics["loss:sum"]
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        print(f"trained {name}: get_info names {training.get_info().model_data.model_name}, loss {loss:.3f}",
              flush=True)
    print(f"saved state {training.save_state('names-state').result().path}", flush=True)
    sampler_path = training.save_weights_for_sampler("names-sampler").result().path
    print(f"saved sampler {sampler_path}", flush=True)
    # A sampler of saved weights asks the server for its base model's tokenizer.
    sampler = service.create_sampling_client(model_path=sampler_path).result()
    assert sampler.get_tokenizer().encode("What is 2 + 2?") == tokenizer.encode("What is 2 + 2?")
    try:
        service.create_lora_training_client(base_model=UNSERVED, rank=8, train_unembed=False).result()
    except tinker.BadRequestError as exc:
        print(f"refused {UNSERVED}: {exc}", flush=True)
    else:
        sys.exit(f"{UNSERVED} was not refused")


if __name__ == "__main__":
    main()
