"""The proof of an export: transformers + peft, on the CPU, load the base model and the adapter as any user
would and compute what SkyRL-tx's restored sampler computed (`ExportReference`); and the merge of the
adapter into the base model.

A base model in bfloat16 (or float16) is computed in that dtype by the cluster, on a grid no float32 model
reproduces; the proof then compares like with like: SkyRL-tx's own forward of the sampler checkpoint, run here in
float32, is what PEFT must reproduce (the same bound, the same greedy tokens). The cluster's own figures are then
only reported against that forward: bfloat16's noise, up to 1.5 nats per token on SmolLM2-135M, is too wide for a
check (the checkpoint is the one evaluate-restore restored and checked against the live model, by its URL and
digests). The merged model must match the PEFT model the same way."""

from __future__ import annotations

from pathlib import Path

from txflow.artifacts.conversion import compute_dtype
from txflow.checkpoints.export import ExportError, ExportReference, Figures


def load_base(base_model_path: str):
    """The base model in float32 on the CPU, as transformers loads it (offline when it is a directory)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_model_path, dtype=torch.float32)


def load_peft(base_model_path: str, peft_dir: Path):
    """Base model + the adapter in `peft_dir`, as `PeftModel.from_pretrained` gives it to any user."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_base(base_model_path), str(peft_dir))


def unapplied_tensors(model, peft_dir: Path) -> list[str]:
    """Adapter tensors in the file that the loaded model has no parameter for (PEFT drops them without a
    word), and LoRA parameters the file did not fill."""
    from safetensors import safe_open

    with safe_open(str(peft_dir / "adapter_model.safetensors"), "pt") as f:
        in_file = set(f.keys())
    in_model = {name.replace(".default", "") for name, _ in model.named_parameters() if ".lora_" in name}
    return sorted(in_file ^ in_model)


ROWS = 8  # sequences or prompts per forward: [8, length, 49k vocabulary] float32 logits stay near 100 MB per 64 tokens


def sequence_logprobs(model, reference: ExportReference) -> list[list[float]]:
    """The model's per-token logprobs of the reference's sequences (each token after the first)."""
    return forward_figures(model, reference.sequences)[0]


def forward_figures(model, sequences: list[list[int]]) -> tuple[list[list[float]], list[list[int]]]:
    """Per sequence, the model's logprob of each token after the first and its most likely token at each of those
    positions, ROWS sequences per forward, padded on the right: attention is causal, so the padding changes no
    real position."""
    import torch

    logprobs, chosen = [], []
    with torch.no_grad():
        for start in range(0, len(sequences), ROWS):
            batch = sequences[start:start + ROWS]
            width = max(len(sequence) for sequence in batch)
            ids = torch.tensor([list(sequence) + [0] * (width - len(sequence)) for sequence in batch])
            logits = model(input_ids=ids).logits[:, :-1]
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            found = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            best = logits.argmax(-1)
            logprobs += [found[i, : len(sequence) - 1].tolist() for i, sequence in enumerate(batch)]
            chosen += [best[i, : len(sequence) - 1].tolist() for i, sequence in enumerate(batch)]
    return logprobs, chosen


def along_path(reference: ExportReference) -> bool:
    """Whether each reference sequence is its prompt followed by the sampler's greedy tokens, as evaluate-restore
    records them (`evaluation.greedy_and_logprobs`). A model's greedy continuation of a prompt is then checked in
    the sequences' own forward: it is those tokens exactly when, at each of their positions, the model's most
    likely next token is the one that follows (`path_greedy`). Older references (held-out prompt + completion)
    are checked by decoding."""
    return len(reference.sequences) == len(reference.prompts) == len(reference.greedy_tokens) and all(
        list(sequence) == list(prompt) + list(greedy)
        for sequence, prompt, greedy in zip(reference.sequences, reference.prompts, reference.greedy_tokens))


def path_greedy(reference: ExportReference, chosen: list[list[int]]) -> list[list[int]]:
    """Per prompt, the most likely next token at each position of its greedy tokens in the reference sequence
    (`chosen`, from `forward_figures`): equal to those tokens exactly when the model continues the prompt greedily
    with them."""
    return [chosen[i][len(prompt) - 1: len(prompt) - 1 + len(greedy)]
            for i, (prompt, greedy) in enumerate(zip(reference.prompts, reference.greedy_tokens))]


def greedy_tokens(model, prompts: list[list[int]], counts: list[int]) -> list[list[int]]:
    """Each prompt's greedy continuation of `counts` tokens, decoded as a server decodes (with the key-value
    cache), ROWS prompts at a time: padded on the left, each row's positions counted from its own first token.
    One prompt at a time, an SFT run's 32 prompts x 8 tokens took 19 s of SmolLM2's export on 2 cores."""
    import torch

    found = []
    with torch.no_grad():
        for start in range(0, len(prompts), ROWS):
            batch, wanted = prompts[start:start + ROWS], counts[start:start + ROWS]
            width = max(len(prompt) for prompt in batch)
            ids = torch.tensor([[0] * (width - len(prompt)) + list(prompt) for prompt in batch])
            mask = torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt) for prompt in batch])
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            rows: list[list[int]] = [[] for _ in batch]
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
            for step in range(max(wanted, default=0)):
                chosen = out.logits[:, -1].argmax(-1)
                for row, token in zip(rows, chosen.tolist()):
                    row.append(token)
                if step + 1 == max(wanted):
                    break
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                positions = positions[:, -1:] + 1
                out = model(input_ids=chosen[:, None], attention_mask=mask, position_ids=positions,
                            past_key_values=out.past_key_values, use_cache=True)
            found += [row[:count] for row, count in zip(rows, wanted)]
    return found


NOISE_TRIALS = 3  # more float32 passes, each rounding its own way, beside the model's own float32 pass
UNIT_ROUNDOFF = 2.0 ** -24  # float32's: the largest relative error of one rounding to nearest


def float32_noise(model, reference: ExportReference, logprobs: list[list[float]]) -> float:
    """How far float32 rounding moves the model's logprobs of the reference's sequences from its float64 ones.

    The float32 `model`'s own `logprobs` against float64 are one draw of that rounding; another float32
    computation (the cluster's, SkyRL-tx's forward) rounds its own way, and where a token is ill-conditioned the
    two draws can be far apart: on the tiny model after 12 SFT steps at lr 1e-2, one token's float32 error was
    1.1e-4 in PEFT and 3.6e-5 on the cluster, and in another run the cluster was 1.08e-4 from PEFT while PEFT's own
    error was at most 1.25e-5. So the noise is the largest of that draw and NOISE_TRIALS more: float32 passes
    whose embeddings are moved at random by float32's unit roundoff, so that every later sum rounds another way.
    The model is then widened in place and narrowed back, which is exact: every float32 is a float64."""
    import torch

    from txflow.checkpoints.export import max_abs_diff

    trials = [_rounded_another_way(model, reference, seed) for seed in range(NOISE_TRIALS)]
    model.to(torch.float64)
    try:
        exact = sequence_logprobs(model, reference)
    finally:
        model.to(torch.float32)
    return max(max_abs_diff(found, exact) for found in [logprobs, *trials])


def _rounded_another_way(model, reference: ExportReference, seed: int) -> list[list[float]]:
    """The model's logprobs with its input embeddings multiplied by 1 + d, d uniform in +-UNIT_ROUNDOFF (drawn
    from `seed`): a perturbation no larger than one rounding, which changes how each later operation rounds."""
    import torch

    draw = torch.Generator().manual_seed(seed)

    def moved(_module, _args, out):
        error = (torch.rand(out.shape, generator=draw, dtype=torch.float64) - 0.5) * 2 * UNIT_ROUNDOFF
        return (out * (1 + error)).to(out.dtype)  # in float32: the value or a neighbour, one unit apart

    hook = model.get_input_embeddings().register_forward_hook(moved)
    try:
        return sequence_logprobs(model, reference)
    finally:
        hook.remove()


def figures(model, reference: ExportReference) -> Figures:
    """The model's per-token logprobs of the reference's sequences and its greedy continuation of each
    reference prompt, as many tokens as the sampler gave (along the sequences when they are prompt + greedy
    tokens: one forward gives both, where decoding would cost about as much again)."""
    if along_path(reference):
        logprobs, chosen = forward_figures(model, reference.sequences)
        return Figures(logprobs=logprobs, greedy_tokens=path_greedy(reference, chosen))
    return Figures(logprobs=sequence_logprobs(model, reference),
                   greedy_tokens=greedy_tokens(model, reference.prompts,
                                               [len(sampled) for sampled in reference.greedy_tokens]))


def prove(base_model_path: str, peft_dir: Path, reference: ExportReference,
          tarball: Path | None = None) -> tuple[Figures, object]:
    """The PEFT model's figures on the reference, with what they must reproduce (`expected`), and the model,
    for a merge. A model the cluster computed in another dtype than float32 is compared like with like:
    `expected` is SkyRL-tx's own forward of the sampler `tarball` in float32, and the cluster's distance from it
    (that dtype's noise) is measured for the report."""
    model = load_peft(base_model_path, peft_dir)
    model.eval()
    found = figures(model, reference)
    found.unapplied = unapplied_tensors(model, peft_dir)
    if compute_dtype(base_model_path) == "float32" or tarball is None:
        found.expected = Figures(logprobs=reference.logprobs, greedy_tokens=reference.greedy_tokens)
        return found, model
    from txflow.upstream.skyrl_tx.reference import skyrl_figures

    along = along_path(reference)
    logprobs, greedy = skyrl_figures(base_model_path, tarball, reference.sequences, reference.prompts,
                                     [len(tokens) for tokens in reference.greedy_tokens], along_sequences=along)
    found.expected = Figures(logprobs=logprobs, greedy_tokens=path_greedy(reference, greedy) if along else greedy)
    gaps = [abs(x - y) for xs, ys in zip(reference.logprobs, logprobs) for x, y in zip(xs, ys)]
    found.cluster_logprob_diff = (max(gaps, default=0.0), sum(gaps) / max(len(gaps), 1))
    return found, model


def merge(peft_model, base_model_path: str, out: Path, config: dict) -> None:
    """Base + LoRA merged, saved with its config and tokenizer so that `from_pretrained(out)` alone loads it."""
    from transformers import AutoTokenizer

    if peft_model.config.tie_word_embeddings and {"embed_tokens", "lm_head"} & set(config["target_modules"]):
        if set(config["target_modules"]) & {"embed_tokens", "lm_head"} != {"embed_tokens", "lm_head"}:
            raise ExportError("the base model ties its embeddings to its output head, and the adapter trains one of "
                              "them alone: a merged model cannot keep both; export the PEFT adapter only")
        # One matrix, one delta (`peft_adapter`'s `tied`): merged through the embedding, which the head shares;
        # merging the head's copy of it as well would add it twice.
        inner = peft_model.base_model.model
        inner.lm_head = inner.lm_head.get_base_layer()
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(base_model_path).save_pretrained(str(out))


