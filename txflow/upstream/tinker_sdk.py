"""The tinker SDK as txflow's own processes import it: without torch.

tinker imports torch when it can (only for its `to_torch`/`from_torch` conversions and custom losses,
which txflow does not use), and torch takes 1-4 s of CPU to import on this kind of machine: a cost every
`txflow run` paid before its first step, export or not. Importing tinker while torch reads as absent
leaves the SDK without those conversions; torch itself stays importable for what needs it (the export).
`from txflow.upstream.tinker_sdk import tinker` everywhere txflow imports the SDK.
"""

from __future__ import annotations

import sys

if "tinker" not in sys.modules and "torch" not in sys.modules:
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError meanwhile
    try:
        import tinker
    finally:
        del sys.modules["torch"]

import tinker  # noqa: E402,F811

__all__ = ["tinker"]
