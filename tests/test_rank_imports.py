"""The `rank-imports` change: a rank imports upstream's backend without torch. The `adapter-config-without-peft`
change: its sampler saves write peft's adapter config, byte for byte, without importing peft (or torch)."""

from __future__ import annotations

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
ranks.install()  # what every rank gets (`ranks.run`)
for name, r, alpha in (("base", 8, 16), ("other/base", 32, 32.0)):
    models.peft.LoraConfig(base_model_name_or_path=name, r=r, lora_alpha=alpha).save_pretrained(
        f"{sys.argv[1]}/{r}")
print("torch" in sys.modules, type(sys.modules["peft"]) is ranks.DeferredModule)
"""


def test_a_rank_imports_the_backend_without_torch_and_writes_peft_s_adapter_config_without_peft(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "USE_TORCH"}
    result = subprocess.run([sys.executable, "-c", RANK, str(tmp_path / "rank")], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    # no torch at the import, peft not loaded; and still neither after two sampler configs written
    assert result.stdout.split() == ["False", "True", "False", "True"]
    for name, r, alpha in (("base", 8, 16), ("other/base", 32, 32.0)):
        peft.LoraConfig(base_model_name_or_path=name, r=r, lora_alpha=alpha).save_pretrained(tmp_path / "peft" / str(r))
        written, direct = ((tmp_path / d / str(r) / "adapter_config.json").read_bytes() for d in ("rank", "peft"))
        assert written == direct and f'"r": {r},'.encode() in written
