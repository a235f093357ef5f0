"""The exported adapter's records: the reference figures an export must reproduce (`ExportReference`, written by
evaluate-restore into the run root), the export's outcome (`ExportResult`), where an export goes in a run root, how
to load one, and finding the reference of a run root or sampler checkpoint (`locate`). Converting, proving and
writing an export is `txflow.artifacts`'s.

The proof's bound: transformers + peft, on the CPU in float32, must reproduce what SkyRL-tx's restored sampler
computed while the cluster was up: the per-token logprobs of fixed sequences within `logprob_bound`, and the greedy
tokens of fixed prompts exactly (`txflow.artifacts.proof` says how a bfloat16 cluster is compared like with like).
"""

from __future__ import annotations

from typing import Any

import fsspec
from pydantic import BaseModel, Field

REFERENCE_NAME = "export-reference.json"
"""In the run root: the figures of the sampler checkpoint that the export must reproduce."""
PROVENANCE_NAME = "txflow-export.json"
"""In each exported directory: where it came from and what the proof measured."""
EXPORT_DIR, PEFT_DIR, MERGED_DIR = "export", "peft", "merged"  # <run_root>/export/{peft,merged}

# Largest |logprob difference| the export may show against SkyRL's figures, per token, when the model's own
# float32 noise is small. Both sides compute in float32; on the tiny model after 3 SFT steps: at most 2e-6
# (docs/exports-and-promotion.md). Right exports have come as far as 1.08e-4 from the cluster's figures while the
# PEFT model's own float32 pass was at most 1.25e-5 from float64 (a custom client's 12 steps at lr 1e-2;
# fourteen repeats here measured 2.9e-6 to 7.4e-5), and 5.4e-5 on SmolLM2-135M against SkyRL-tx's float32
# forward. A wrong export is off by far more: 0.15 nats at the least (alpha wrong by 2x), 0.2-0.6 with upstream's
# config (LoRA on 2 of 7 modules), 1.6-1.9 with a module dropped. 3e-4 leaves about 3x room over the right
# exports seen and is 500x below the nearest wrong one.
LOGPROB_BOUND = 3e-4
# Two float32 computations of one model in different orders differ by about the model's float32 noise (its
# float32 logprobs against its float64 ones, `proof.float32_noise`), which a hard-trained adapter makes large at a
# few tokens: the tiny model after 12 SFT steps at lr 1e-2 showed 4.3e-5 of noise and PEFT 7.0e-5 from the
# cluster. On the tiny model with LoRA B drawn at 0.05-10 x N(0, 1) (tests/test_export.py), PEFT was 0.55-2.8x its
# noise from SkyRL-tx's forward (each side rounds its own way, at the same tokens); a wrong alpha or a dropped
# module were 0.15-1000 nats off. So the bound is the larger of LOGPROB_BOUND and NOISE_FACTOR x the measured noise
# (about 3x room over the largest ratio seen), up to LOGPROB_CEILING: past it, float32 cannot reproduce the
# model's figures to within a hundredth of the smallest wrong figure, and the proof says so rather than pass a
# bound that means nothing.
NOISE_FACTOR = 8.0
LOGPROB_CEILING = 1e-2


def logprob_bound(noise: float | None) -> float:
    """The proof's bound for a model whose float32 noise on the reference is `noise` (None: not measured)."""
    return max(LOGPROB_BOUND, NOISE_FACTOR * (noise or 0.0))


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message says why and what to do."""


class ExportReference(BaseModel):
    """What SkyRL-tx's restored sampler computed: the figures an export of that sampler must reproduce."""

    sampler_url: str = Field(description="The committed sampler checkpoint these figures are of")
    base_model: str = Field(description="The base model as the user named it (hub id, path, or `tiny`)")
    sequences: list[list[int]] = Field(description="Each held-out prompt followed by the sampler's greedy tokens")
    logprobs: list[list[float]] = Field(description="Per sequence, the logprob of each token after the first")
    prompts: list[list[int]]
    greedy_tokens: list[list[int]] = Field(description="The sampler's greedy continuation of each prompt")
    lora: dict[str, Any] | None = Field(default=None, description="The slot the sampler was restored into: `rank` "
                                        "and the modules it trains (`train_attn`, `train_mlp`, `train_unembed`), "
                                        "what a cluster that serves it must create")


class Figures(BaseModel):
    """What one model computed on a reference's sequences and prompts."""

    logprobs: list[list[float]]
    greedy_tokens: list[list[int]]
    unapplied: list[str] = Field(default_factory=list,
                                 description="Adapter tensors the loaded model did not apply (should be none)")
    expected: Figures | None = Field(default=None, description="What these figures must reproduce (prove sets it)")
    cluster_logprob_diff: tuple[float, float] | None = Field(
        default=None, description="A model not in float32: the cluster's figures against `expected`, (max, mean) "
        "of |Δ logprob|")


class ExportResult(BaseModel):
    """The export-adapter step's outcome, and what `txflow export` prints."""

    sampler_url: str
    peft_url: str | None = None
    merged_url: str | None = None
    base_model: str
    target_modules: list[str]
    r: int
    lora_alpha: float
    logprob_bound: float = Field(default=LOGPROB_BOUND, description="The bound the PEFT (and merged) model's "
                                 "|Δ logprob| is held to: `logprob_bound(float32_noise)`")
    float32_noise: float | None = Field(default=None, description="The PEFT model in float32 against itself in "
                                        "float64, the largest |Δ logprob|: the rounding any float32 computation of "
                                        "these sequences makes; measured when the bound could depend on it (else "
                                        "None)")
    max_abs_logprob_diff: float
    greedy_tokens_match: bool
    compared_against: str = Field(default="the cluster's figures",
                                  description="What PEFT was compared with: the cluster's figures (a float32 model), "
                                  "or SkyRL-tx's forward of the checkpoint in float32 (a bfloat16 or float16 one)")
    cluster_max_abs_logprob_diff: float | None = Field(
        default=None, description="A bfloat16 or float16 model: the cluster's logprobs against SkyRL-tx's float32 "
        "forward of the checkpoint, the largest |Δ| (that dtype's noise; reported, not checked)")
    cluster_mean_abs_logprob_diff: float | None = Field(default=None, description="The same, the mean |Δ|")
    merged_max_abs_logprob_diff: float | None = None
    merged_greedy_tokens_match: bool | None = None
    notes: list[str] = Field(default_factory=list, description="What known servers would refuse or misread")
    problem: str | None = None
    passed: bool
    seconds: float = 0.0


def noise_note(result: ExportResult) -> str:
    """What the bound was made of, when the model's float32 noise widened it ("" otherwise)."""
    if result.float32_noise is None or result.logprob_bound <= LOGPROB_BOUND:
        return ""
    return f": {NOISE_FACTOR:g}x the model's own float32 noise, {result.float32_noise:.2e}"


def failure(result: ExportResult) -> str | None:
    """Which check of the export failed, with the value found and the bound; None when it passed."""
    problems = [result.problem] if result.problem else []
    if result.logprob_bound > LOGPROB_CEILING:
        problems.append(f"float32 cannot reproduce this model's figures closely enough to prove the export: its own "
                        f"float32 logprobs are {result.float32_noise or 0.0:.3g} from float64 ones, a bound of "
                        f"{result.logprob_bound:.3g} > {LOGPROB_CEILING:g} would not tell a wrong export")
    if not result.max_abs_logprob_diff <= result.logprob_bound:
        problems.append(f"PEFT adapter: max |Δ logprob| {result.max_abs_logprob_diff:.3g} > {result.logprob_bound:g} "
                        f"allowed")
    if not result.greedy_tokens_match:
        problems.append("PEFT adapter: greedy tokens differ from SkyRL's")
    merged = result.merged_max_abs_logprob_diff
    if merged is not None and not merged <= result.logprob_bound:
        problems.append(f"merged model: max |Δ logprob| {result.merged_max_abs_logprob_diff:.3g} > "
                        f"{result.logprob_bound:g} allowed")
    if result.merged_greedy_tokens_match is False:
        problems.append("merged model: greedy tokens differ from the PEFT model's")
    return "; ".join(problems) or None


# --- the adapter -----------------------------------------------------------------------------------------


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest |difference| between two sets of per-token logprobs (inf when their shapes differ)."""
    if [len(x) for x in a] != [len(y) for y in b]:
        return float("inf")
    return max((abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


def load_instructions(base: str, merged: bool) -> str:
    """How to load an export with transformers + peft, vLLM, or transformers alone (merged)."""
    if merged:
        return ("```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
                "model = AutoModelForCausalLM.from_pretrained(\"<this directory>\")\n"
                "tokenizer = AutoTokenizer.from_pretrained(\"<this directory>\")\n```\n\n"
                "vLLM serves it like any model: `vllm serve <this directory>`.")
    return ("```python\nfrom transformers import AutoModelForCausalLM\nfrom peft import PeftModel\n"
            f"base = AutoModelForCausalLM.from_pretrained(\"{base}\")\n"
            "model = PeftModel.from_pretrained(base, \"<this directory>\")\n```\n\n"
            f"vLLM: `vllm serve {base} --enable-lora --lora-modules adapter=<this directory>` "
            "(with `--max-lora-rank` at least the adapter's r).")


def run_root_of(sampler_url: str) -> str:
    """The run root of a sampler checkpoint: it lies at <run root>/<model id>/sampler_weights/<name>.tar.gz."""
    return sampler_url.rstrip("/").rsplit("/", 3)[0]


def locate(url: str, options: dict) -> tuple[str, ExportReference]:
    """(run root, reference figures) for `txflow export URL`: URL is a run root, or the sampler checkpoint of
    one that evaluate-restore checked. Raises ExportError when it is neither, or the checkpoint is not
    committed or does not match its digests."""
    from txflow.checkpoints.discovery import discover

    url = url.rstrip("/")
    is_sampler = url.endswith(".tar.gz")
    run_root = run_root_of(url) if is_sampler else url
    try:
        reference = read_reference(run_root, options)
    except (OSError, ValueError) as exc:
        raise ExportError(f"{url}: cannot read {REFERENCE_NAME} under {run_root} "
                          f"({type(exc).__name__}: {exc})") from None
    if reference is None:
        raise ExportError(f"{url} is not a txflow run root with a checked sampler checkpoint: {run_root} has no "
                          f"{REFERENCE_NAME} (evaluate-restore writes it when a run's restore check passes)")
    if is_sampler and reference.sampler_url.rstrip("/") != url:
        raise ExportError(f"{url}: the run's reference figures are of {reference.sampler_url}, the sampler checkpoint "
                          f"evaluate-restore checked; only that one can be exported with its proof")
    try:
        found = next((a for a in discover(run_root, options, require_commit=True)
                      if a.url.rstrip("/") == reference.sampler_url.rstrip("/")), None)
    except FileNotFoundError:
        found = None
    if found is None:
        raise ExportError(f"{url}: the sampler checkpoint {reference.sampler_url} is not there")
    if not (found.complete and found.committed):
        raise ExportError(f"{url}: the sampler checkpoint {reference.sampler_url} is not usable: {found.reason}")
    return run_root, reference


def read_reference(run_root: str, options: dict) -> ExportReference | None:
    """The reference figures recorded in a run root, or None."""
    fs, path = fsspec.core.url_to_fs(run_root, **options)
    try:
        return ExportReference.model_validate_json(fs.cat_file(f"{path.rstrip('/')}/{REFERENCE_NAME}"))
    except FileNotFoundError:
        return None


def write_reference(run_root: str, options: dict, reference: ExportReference) -> str:
    fs, path = fsspec.core.url_to_fs(run_root, **options)
    fs.pipe_file(f"{path.rstrip('/')}/{REFERENCE_NAME}", reference.model_dump_json(indent=1).encode())
    return f"{run_root.rstrip('/')}/{REFERENCE_NAME}"
