"""A tiny Qwen3-architecture model built locally, so the default run is offline.

Two layers, hidden size 64, a byte-level BPE tokenizer trained on the bundled
text: small enough that a JAX step takes a fraction of a second on a CPU, real
enough that SkyRL-tx loads it through `--base-model <dir>` like any Hugging Face
checkpoint. Deterministic from the seed; built once into a cache directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from txflow.config import NAMED_MODELS, TINY_MODEL
from txflow.upstream.named_models import build_named_model

VOCAB_SIZE = 300
ARCH = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    # Untied, with the output head initialised as a copy of the embeddings (the same function as a tied
    # model): SkyRL-tx can then train LoRA on both when a client asks, as the Tinker SDK does by default.
    "tie_word_embeddings": False,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
BUILD_VERSION = 2


def cache_dir() -> Path:
    """Where built models live: $TXFLOW_CACHE or ~/.cache/txflow."""
    return Path(os.environ.get("TXFLOW_CACHE", Path.home() / ".cache" / "txflow"))


def _corpus() -> list[str]:
    lines = []
    for name in ("sft.jsonl", "rl_prompts.jsonl"):
        text = resources.files("txflow.data").joinpath(name).read_text()
        for line in text.splitlines():
            if line.strip():
                row = json.loads(line)
                lines.extend(str(v) for v in row.values())
    return lines


def build_tiny_model(seed: int = 0, root: Path | None = None) -> Path:
    """Build (or reuse) the tiny model for `seed`; returns its directory."""
    corpus = _corpus()
    key = hashlib.sha256(json.dumps([BUILD_VERSION, seed, ARCH, VOCAB_SIZE, corpus]).encode()).hexdigest()[:12]
    target = (root or cache_dir()) / f"tiny-qwen3-{key}"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a concurrent run never sees half a model.
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        _write_tokenizer(staging, corpus)
        _write_model(staging, seed)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_tokenizer(out: Path, corpus: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[1])
    fast.save_pretrained(out)


def _write_model(out: Path, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(out)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
        **ARCH,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.save_pretrained(out, safe_serialization=True)


def resolve_base_model(name: str, seed: int = 0) -> str:
    """The path or hub id SkyRL-tx should load for `--base-model name`: the tiny model or a named model built
    into the cache, a local directory as an absolute path (processes may run elsewhere, and an export names
    it), a hub id as given. A named model whose wheel is missing raises NamedModelMissing."""
    if name == TINY_MODEL:
        return str(build_tiny_model(seed))
    if name in NAMED_MODELS:
        return str(build_named_model(name, cache_dir()))
    path = Path(name).expanduser()
    return str(path.absolute()) if path.is_dir() else name
