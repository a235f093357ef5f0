"""txflow imports the tinker SDK without torch (`txflow.upstream.tinker_sdk`): a fresh interpreter, as
`txflow run` is, builds and reads a Datum with torch never imported, and torch still imports after."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = """
import json, sys
from txflow.training import sft
datum = sft.to_datum(([5, 6, 7], [0.0, 1.0, 1.0]))
before = "torch" in sys.modules
import torch
print(json.dumps({"weights": datum.loss_fn_inputs["weights"].tolist(), "torch_before": before,
                  "torch_after": torch.tensor([1.0]).tolist()}))
"""


def test_the_sdk_is_imported_without_torch_and_torch_still_imports_after():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found == {"weights": [0.5, 0.5], "torch_before": False, "torch_after": [1.0]}
