"""The model's tokenizer, loaded without transformers where possible.

`transformers` imports torch (~6 s here), and pre-flight, which tokenizes the
whole dataset, must answer bad input within seconds. A Hugging Face model
directory with a `tokenizer.json` (every fast tokenizer, Qwen3 included) is
loaded with the `tokenizers` library directly, which gives the same ids; other
models fall back to `AutoTokenizer`. A model's chat template (its
`chat_template.jinja`, or the one in `tokenizer_config.json`) is rendered with
jinja2 the way transformers renders it.
"""

from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    """What txflow asks of a tokenizer: encode without special tokens, EOS id, decode, the chat template."""

    def __init__(self, backend, eos_token_id: int | None, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None):
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}

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
        special = {}
        for role in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = config.get(role)
            value = value.get("content") if isinstance(value, dict) else value
            if value:
                special[role] = value
        template_path = directory / "chat_template.jinja"  # where transformers >= 4.47 saves it
        template = template_path.read_text() if template_path.exists() else config.get("chat_template")
        eos = special.get("eos_token")
        return Tokenizer(backend, backend.token_to_id(eos) if eos else None,
                         template if isinstance(template, str) else None, special)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def chat_template(tokenizer) -> str | None:
    """The tokenizer's chat template (a single jinja template), or None when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) and template.strip() else None


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    """`messages` rendered with the tokenizer's chat template, as transformers' `apply_chat_template(...,
    tokenize=False)` renders them (same sandbox, whitespace rules and variables)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    special = getattr(tokenizer, "special_tokens", None)
    if special is None:  # a transformers tokenizer
        special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    return env.from_string(chat_template(tokenizer)).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special)
