"""The model's tokenizer, loaded without transformers where possible.

`transformers` imports torch (~6 s here), and pre-flight, which tokenizes the
whole dataset, must answer bad input within seconds. A Hugging Face model
directory with a `tokenizer.json` (every fast tokenizer, Qwen3 included) is
loaded with the `tokenizers` library directly, which gives the same ids; other
models fall back to `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    """The three things txflow asks of a tokenizer: encode without special tokens, EOS id, decode."""

    def __init__(self, backend, eos_token_id: int | None):
        self.backend = backend
        self.eos_token_id = eos_token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def _local_dir(model: str) -> Path | None:
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:  # a hub id already in the local Hugging Face cache (nothing is downloaded)
        return Path(snapshot_download(model, local_files_only=True, allow_patterns=["tokenizer*", "*.json"]))
    except (LocalEntryNotFoundError, HFValidationError):
        return None  # not cached, or not a hub id: transformers says which below


def load_tokenizer(model: str):
    """A tokenizer for `model` (a local directory or a hub id)."""
    directory = _local_dir(model)
    if directory is not None and (directory / "tokenizer.json").exists():
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        eos = config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        return Tokenizer(backend, backend.token_to_id(eos) if eos else None)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)
