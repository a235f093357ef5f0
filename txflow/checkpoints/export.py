"""The exported adapter's records and files: the reference figures an export must reproduce
(`ExportReference`), the export's outcome (`ExportResult`), the conversion of SkyRL-tx's sampler tarball
into a Hugging Face PEFT adapter, the model card, and where an export goes. Loading models to prove or
merge it is `txflow.export`'s.

SkyRL-tx 0.3.0's sampler tarball is PEFT-shaped but not PEFT-correct: its `adapter_config.json` says
`"target_modules": null`, so PEFT falls back to its default for the architecture (`q_proj`, `v_proj` for
Qwen3) and silently drops the other trained modules, and it names the base model by the engine's own
path. `peft_adapter` writes the same weights with a config that lists exactly the modules that have
weights (embedding LoRA renamed and transposed to PEFT's layout), the rank and alpha SkyRL scales by
(alpha / rank, as PEFT does), and the base model as the user named it.

The proof (`txflow.export.proof`): transformers + peft, on the CPU in float32, must reproduce what SkyRL-tx's restored
sampler computed while the cluster was up (`ExportReference`, recorded by evaluate-restore): the
per-token logprobs of fixed sequences within `LOGPROB_BOUND`, and the greedy tokens of fixed prompts
exactly. A base model in bfloat16 (or float16) is computed in that dtype by the cluster, on a grid no
float32 model reproduces; the proof then compares like with like: SkyRL-tx's own forward of the sampler
checkpoint, run here in float32, is what PEFT must reproduce (the same bound, the same greedy tokens). The
cluster's own figures are then only reported against that forward: bfloat16's noise, up to 1.5 nats per
token on SmolLM2-135M, is too wide for a check (the checkpoint is the one evaluate-restore restored and
checked against the live model, by its URL and digests).
The merged model must match the PEFT model the same way. An export is written to local staging
and committed like every checkpoint (its files, then the marker with every digest, last), and only when
the proof holds.
"""

from __future__ import annotations

import json
import re
import tarfile
import time
from pathlib import Path
from typing import Any

import fsspec
from pydantic import BaseModel, Field

from txflow.checkpoints.markers import COMMIT_SUFFIX

REFERENCE_NAME = "export-reference.json"
"""In the run root: the figures of the sampler checkpoint that the export must reproduce."""
PROVENANCE_NAME = "txflow-export.json"
"""In each exported directory: where it came from and what the proof measured."""
EXPORT_DIR, PEFT_DIR, MERGED_DIR = "export", "peft", "merged"  # <run_root>/export/{peft,merged}

# Largest |logprob difference| the export may show against SkyRL's sampler, per token. Both sides compute
# in float32; measured on the tiny model: at most 2e-6 (docs/exports-and-promotion.md). A wrong
# export is off by far more: 0.2-0.6 nats with upstream's config (LoRA on 2 of 7 modules), a dropped
# module or alpha wrong by 2x. The bound leaves 50x room for other models' reduction orders.
LOGPROB_BOUND = 1e-4
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices (vllm/config/lora.py)
_LORA_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight")


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message says why and what to do."""


class ExportReference(BaseModel):
    """What SkyRL-tx's restored sampler computed: the figures an export of that sampler must reproduce."""

    sampler_url: str = Field(description="The committed sampler checkpoint these figures are of")
    base_model: str = Field(description="The base model as the user named it (hub id, path, or `tiny`)")
    sequences: list[list[int]] = Field(description="Fixed held-out sequences (prompt and completion)")
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
    logprob_bound: float = LOGPROB_BOUND
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


def failure(result: ExportResult) -> str | None:
    """Which check of the export failed, with the value found and the bound; None when it passed."""
    problems = [result.problem] if result.problem else []
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


def extract_sampler(tarball: Path, into: Path) -> Path:
    """Unpack a SkyRL-tx sampler tarball (adapter_config.json and adapter_model.safetensors) into `into`."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(into, filter="data")
    missing = [n for n in ("adapter_config.json", "adapter_model.safetensors") if not (into / n).is_file()]
    if missing:
        raise ExportError(f"{tarball.name} is not a SkyRL-tx sampler checkpoint: it has no {', '.join(missing)}")
    return into


def peft_adapter(sampler_dir: Path, out: Path, base_model: str, tied: bool = False) -> dict:
    """Write the PEFT adapter of the sampler checkpoint unpacked in `sampler_dir` into `out`; returns its
    adapter_config. Linear LoRA weights are already in PEFT's orientation, (r, in) and (out, r); SkyRL's
    embedding LoRA is (vocab, r) and (r, hidden), PEFT's is `lora_embedding_A` (r, vocab) and
    `lora_embedding_B` (hidden, r).

    `tied`: the base model ties its output head to its embedding, and the cluster applied the embedding's LoRA
    at both ends (the head's logits h (E + s A B)^T). PEFT applies an embedding's LoRA to the lookup only, so
    the head gets the same product as a LoRA of its own: `lm_head.lora_A` is B (r, hidden), `lora_B` is A
    (vocab, r). A merge adds that shared delta once (`export.proof.merge`)."""
    from safetensors.torch import load_file, save_file

    upstream = json.loads((sampler_dir / "adapter_config.json").read_text())
    rank = int(upstream["r"])
    converted, modules = {}, set()
    for key, value in load_file(sampler_dir / "adapter_model.safetensors").items():
        match = _LORA_KEY.fullmatch(key)
        if match is None:
            raise ExportError(f"{key!r} is not a LoRA weight of a dense model as SkyRL-tx 0.3.0 writes it "
                              f"(mixture-of-experts adapters are not exported yet)")
        module, which = match["module"], match["which"]
        leaf = module.rsplit(".", 1)[-1]
        modules.add(leaf)
        if leaf == "embed_tokens":
            converted[f"base_model.model.{module}.lora_embedding_{which}"] = value.T.contiguous()
            if tied:
                converted[f"base_model.model.lm_head.lora_{'B' if which == 'A' else 'A'}.weight"] = value.contiguous()
                modules.add("lm_head")
        else:
            if (value.shape[0] if which == "A" else value.shape[1]) != rank:
                raise ExportError(f"{key} has shape {list(value.shape)}, not of rank {rank}")
            converted[key] = value.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(converted, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    alpha = float(upstream["lora_alpha"])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,  # SkyRL scales by alpha / r, as PEFT does
        "target_modules": sorted(modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def serving_notes(config: dict, base_model: str, base_model_path: str) -> list[str]:
    """What a known server would refuse or misread in this adapter, said plainly."""
    notes = []
    unembed = sorted(set(config["target_modules"]) & {"embed_tokens", "lm_head"})
    if unembed:
        notes.append(f"LoRA on {' and '.join(unembed)}: vLLM serves it only for some architectures and versions, "
                     f"SGLang not yet; serve the merged model instead (export it with --merged).")
    rank = config["r"]
    if rank > VLLM_RANKS[-1]:
        notes.append(f"rank {rank} is above the largest --max-lora-rank vLLM accepts ({VLLM_RANKS[-1]}); serve "
                     f"the merged model instead.")
    elif rank not in VLLM_RANKS:
        fit = next(r for r in VLLM_RANKS if r >= rank)
        notes.append(f"rank {rank} is not one of vLLM's --max-lora-rank values {list(VLLM_RANKS)}: serve it "
                     f"with --max-lora-rank {fit}.")
    if base_model_path == base_model and Path(base_model).is_absolute():
        notes.append(f"the base model is a local path only ({base_model}): vLLM and SGLang do not read it from "
                     f"the adapter; serve the same weights from that path or a copy of it.")
    return notes


def ties_embeddings(base_model_path: str) -> bool:
    """Whether the base model's config.json ties its output head to its input embedding."""
    config = Path(base_model_path) / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("tie_word_embeddings", False))


def compute_dtype(base_model_path: str) -> str:
    """The dtype SkyRL-tx computes the base model in: its config.json's (float32 when it names none)."""
    config = Path(base_model_path) / "config.json"
    values = json.loads(config.read_text()) if config.is_file() else {}
    return str(values.get("dtype") or values.get("torch_dtype") or "float32").removeprefix("torch.")


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest |difference| between two sets of per-token logprobs (inf when their shapes differ)."""
    if [len(x) for x in a] != [len(y) for y in b]:
        return float("inf")
    return max((abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)), default=0.0)


def model_card(result: ExportResult, run: dict, merged: bool) -> str:
    """README.md of an exported directory: what it is, where it came from, how it was proven, how to load it."""
    base = result.base_model
    lines = [f"# {'Merged model' if merged else 'LoRA adapter'} of txflow run `{run.get('run_id') or 'unknown'}`", "",
             f"- base model: `{base}`", f"- mode: {run.get('mode')}, steps: {run.get('steps')}",
             f"- dataset: `{run.get('dataset')}`",
             f"- source: `{result.sampler_url}` (SkyRL-tx sampler checkpoint)",
             f"- LoRA: r {result.r}, lora_alpha {result.lora_alpha:g}, on {', '.join(result.target_modules)}"]
    lines += [f"- {key}: {value:.4f}" if isinstance(value, float) else f"- {key}: {value}"
              for key, value in (run.get("quality") or {}).items()]
    lines += ["", "## Proof", "",
              f"transformers + peft (CPU, float32) reproduce SkyRL-tx's restored sampler: max |Δ logprob| "
              f"{result.max_abs_logprob_diff:.2e} (bound {result.logprob_bound:g}), greedy tokens identical: "
              f"{result.greedy_tokens_match}; compared against {result.compared_against}."]
    if result.cluster_max_abs_logprob_diff is not None:
        lines.append(f"The cluster computed in the base model's dtype; its figures differ from SkyRL-tx's float32 "
                     f"forward by that dtype's noise: max |Δ logprob| {result.cluster_max_abs_logprob_diff:.3g}, mean "
                     f"{result.cluster_mean_abs_logprob_diff:.3g}.")
    if result.merged_max_abs_logprob_diff is not None:
        lines.append(f"The merged model matches the PEFT model: max |Δ logprob| "
                     f"{result.merged_max_abs_logprob_diff:.2e}, greedy tokens identical: "
                     f"{result.merged_greedy_tokens_match}.")
    lines += ["", "## Loading it", "", load_instructions(base, merged)]
    if result.notes:
        lines += ["", "## Serving notes", ""] + [f"- {note}" for note in result.notes]
    if run.get("base_model_source") == "tiny":
        lines += ["", "The base model is txflow's bundled tiny model, built locally; rebuild it on another machine "
                  "with `python -c 'from txflow.upstream.tiny_model import build_tiny_model; "
                  "print(build_tiny_model())'` (the same seed gives the same weights) and load from the path it "
                  "prints."]
    return "\n".join(lines) + "\n"


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


def prepare_destination(dest: str, options: dict, force: bool, sampler_url: str | None = None,
                        keep_others: bool = False) -> str | None:
    """Make `dest` ready for an export of `sampler_url`. What is there is replaced when it is an export of
    the same sampler (a retry of this export) or with `force`; with `keep_others`, an export of another
    sampler (a run continued with --resume-from) moves to `<dest>-<time>`, whose URL is returned;
    anything else is refused."""
    fs, path = fsspec.core.url_to_fs(dest, **options)
    path = path.rstrip("/")
    try:
        found = [p for p, info in fs.find(path, detail=True).items() if info.get("type", "file") == "file"]
    except FileNotFoundError:
        found = []
    if not found:
        return None
    source = _exported_from(fs, path)
    if keep_others and source is not None and source != sampler_url:
        kept = f"{dest.rstrip('/')}-{int(time.time())}"
        fs.mv(path, fsspec.core.url_to_fs(kept, **options)[1], recursive=True)
        return kept
    if not (force or (sampler_url is not None and source == sampler_url)):
        raise ExportError(f"--to {dest} exists and is not empty; choose another destination, or pass --force to "
                          f"replace what is there")
    for name in (PEFT_DIR, MERGED_DIR):  # the marker first: a half-deleted export reads incomplete
        for target in (f"{path}/{name}{COMMIT_SUFFIX}", f"{path}/{name}"):
            if fs.exists(target):
                fs.rm(target, recursive=True)
    return None


def _exported_from(fs, path: str) -> str | None:
    try:
        return json.loads(fs.cat_file(f"{path}/{PEFT_DIR}/{PROVENANCE_NAME}"))["sampler_url"]
    except (FileNotFoundError, KeyError, ValueError):
        return None


def locate(url: str, options: dict) -> tuple[str, ExportReference]:
    """(run root, reference figures) for `txflow export URL`: URL is a run root, or the sampler checkpoint of
    one that evaluate-restore checked. Raises ExportError when it is neither, or the checkpoint is not
    committed or does not match its digests."""
    from txflow.checkpoints.discovery import discover

    url = url.rstrip("/")
    is_sampler = url.endswith(".tar.gz")
    # A sampler checkpoint lies at <run root>/<model id>/sampler_weights/<name>.tar.gz.
    run_root = url.rsplit("/", 3)[0] if is_sampler else url
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


def available_base_model(name: str) -> str:
    """A path transformers loads `name` from on this machine, without the network; ExportError otherwise."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser().absolute())
    if name.startswith(("/", ".", "~")):
        raise ExportError(f"the base model {name} is not on this machine; pass --base-model with its directory")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(name, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError, OSError):
        raise ExportError(f"the base model {name} is not available on this machine (not in the Hugging Face cache); "
                          f"download it first, or pass --base-model with its directory") from None


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
