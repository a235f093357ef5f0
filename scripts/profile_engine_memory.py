"""Where the engine's memory goes with the number of adapter slots: SkyRL-tx's JAX backend in this process with the
changes every rank gets (`bench_roofline.engine`), one model of LoRA rank 32, SFT steps of 4 rows x 60 tokens. For
each step it prints the resident set before forward_backward, its peak during it, and the same for optim_step
(sampled every 10 ms). Not part of txflow; run it with MALLOC_ARENA_MAX=2, as every rank runs.

    MALLOC_ARENA_MAX=2 python scripts/profile_engine_memory.py --base-model smollm2-135m --slots 8 [--steps 5]
        [--models 1]

`--models N` creates N models (as N runs attached to a shared cluster would) and trains the first.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_engine_step import memory_mib  # noqa: E402


def rss_mib() -> int:
    return memory_mib()["VmRSS"]


class Peak:
    """The highest resident set since the last `reset`, sampled by a thread."""

    def __init__(self):
        self.value = rss_mib()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        while True:
            self.value = max(self.value, rss_mib())
            time.sleep(0.01)

    def reset(self) -> int:
        self.value = rss_mib()
        return self.value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", type=int, default=1)
    args = parser.parse_args()

    import bench_roofline

    from txflow.upstream.tiny_model import resolve_base_model

    peak = Peak()
    impl = bench_roofline.engine(resolve_base_model(args.base_model), args.slots, 32)
    batch = bench_roofline.train_batch([[(i * 7 + j) % 4000 + 10 for j in range(60)] for i in range(4)], 10,
                                       "cross_entropy")
    print(f"{args.slots} slots: {rss_mib()} MiB with the model created", flush=True)
    if args.models > 1:
        from tx.tinker import types

        for i in range(1, args.models):
            impl.create_model(f"other-{i}", types.LoraConfig(rank=32, alpha=32.0, seed=i))
        print(f"{args.models} models: {rss_mib()} MiB", flush=True)
    for step in range(1, args.steps + 1):
        before = peak.reset()
        impl.forward_backward(batch)
        time.sleep(0.05)
        during, before_optimizer = peak.value, peak.reset()
        bench_roofline.optimizer_step(impl)
        time.sleep(0.05)
        print(f"step {step}: forward_backward {before} -> peak {during} MiB (+{during - before}); optim_step "
              f"{before_optimizer} -> peak {peak.value} MiB; after {rss_mib()} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
