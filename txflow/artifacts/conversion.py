"""SkyRL-tx's sampler tarball made a Hugging Face PEFT adapter, its model card, and where an export may be written.

SkyRL-tx 0.3.0's sampler tarball is PEFT-shaped but not PEFT-correct: its `adapter_config.json` says
`"target_modules": null`, so PEFT falls back to its default for the architecture (`q_proj`, `v_proj` for
Qwen3) and silently drops the other trained modules, and it names the base model by the engine's own
path. `peft_adapter` writes the same weights with a config that lists exactly the modules that have
weights (embedding LoRA renamed and transposed to PEFT's layout), the rank and alpha SkyRL scales by
(alpha / rank, as PEFT does), and the base model as the user named it."""

from __future__ import annotations

import json
import re
import tarfile
import time
from pathlib import Path

import fsspec

from txflow.checkpoints.export import (
    MERGED_DIR,
    PEFT_DIR,
    PROVENANCE_NAME,
    ExportError,
    ExportResult,
    load_instructions,
    noise_note,
)
from txflow.checkpoints.markers import COMMIT_SUFFIX

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices (vllm/config/lora.py)
_LORA_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight")


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
    (vocab, r). A merge adds that shared delta once (`txflow.artifacts.proof.merge`)."""
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
              f"{result.max_abs_logprob_diff:.2e} (bound {result.logprob_bound:.3g}{noise_note(result)}), greedy "
              f"tokens identical: {result.greedy_tokens_match}; compared against {result.compared_against}."]
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
