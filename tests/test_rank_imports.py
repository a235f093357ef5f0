"""The `rank-imports` change: a rank imports upstream's backend without torch, and peft, loaded at its first use,
writes the same adapter config as when it is imported up front."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import peft

RANK = """
import sys
from txflow.upstream.skyrl_tx import ranks
ranks.imports_without_torch()
import tx.tinker.backends.jax
import tx.utils.models as models
print("torch" in sys.modules, "peft" in sys.modules and type(sys.modules["peft"]) is ranks.DeferredModule)
models.peft.LoraConfig(base_model_name_or_path="base", r=8, lora_alpha=16).save_pretrained(sys.argv[1])
"""


def test_a_rank_imports_the_backend_without_torch_and_peft_writes_the_same_config_later(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "USE_TORCH"}
    result = subprocess.run([sys.executable, "-c", RANK, str(tmp_path / "rank")], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "True"]  # no torch at the import; peft not loaded until used
    peft.LoraConfig(base_model_name_or_path="base", r=8, lora_alpha=16).save_pretrained(tmp_path / "direct")
    written, direct = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("rank", "direct"))
    assert written == direct and written["r"] == 8 and written["lora_alpha"] == 16
