"""The `freed-memory-returned` change: after an evaluation's or a checkpoint's request a rank gives the memory its
allocator holds free back to the system; a training step's requests are left as they are, and every wrapped request
keeps the annotations that serialise its broadcast to the workers."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import typing

from tx.tinker.backends import jax as backend

from txflow.upstream.skyrl_tx import ranks

# In a fresh process: a request that leaves ~400 MB free in glibc's heap (small blocks between ones it keeps, which
# malloc cannot give back by shrinking the heap), then the resident set before and after the same request again,
# wrapped by the change or not.
PROBE = """
import sys
from txflow.upstream.skyrl_tx import ranks
ranks.imports_without_torch()  # as a rank imports the backend
from tx.tinker.backends.jax import JaxBackendImpl

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 // 2**20

survivors = []

def sample(self, prepared_batch):
    blocks = [bytearray(4000) for _ in range(100_000)]
    survivors.extend(blocks[::50])  # 2% kept, spread through the heap: it cannot shrink from its top
    del blocks
    return {}

JaxBackendImpl.sample = sample
JaxBackendImpl.sample(None, None)
kept = rss_mb()
if sys.argv[1] == "wrapped":
    ranks.freed_memory_returned()
JaxBackendImpl.sample(None, None)
print(kept, rss_mb())
"""


def resident_after(mode: str) -> tuple[int, int]:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                            env={"MALLOC_ARENA_MAX": "2", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    before, after = map(int, result.stdout.split())
    return before, after


def test_a_wrapped_request_gives_the_memory_it_freed_back_and_an_unwrapped_one_keeps_it():
    kept_before, kept_after = resident_after("unwrapped")
    before, after = resident_after("wrapped")
    assert kept_after > kept_before - 50  # glibc keeps what the request freed
    assert after < before - 250, (before, after)  # ~400 MB freed, given back


def test_evaluation_and_checkpoint_requests_trim_after_they_ran_and_training_steps_do_not(monkeypatch):
    events = []

    class Libc:
        @staticmethod
        def malloc_trim(pad):
            events.append(("trim", pad))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc)
    names = (*ranks.RETURNS_FREED_MEMORY, "forward_backward", "optim_step")
    upstream = {name: getattr(backend.JaxBackendImpl, name) for name in names}
    for name in names:
        def request(self, *args, name=name, **kwargs):
            events.append(("ran", name))
            if name == "load_checkpoint":
                raise RuntimeError("a failed request returns its memory too")
            return name

        monkeypatch.setattr(backend.JaxBackendImpl, name, request)
    ranks.freed_memory_returned()
    ranks.freed_memory_returned()  # installed once, however often asked
    for name in names:
        events.clear()
        try:
            assert getattr(backend.JaxBackendImpl, name)(object()) == name
        except RuntimeError:
            assert name == "load_checkpoint"
        assert events == ([("ran", name), ("trim", 0)] if name in ranks.RETURNS_FREED_MEMORY else [("ran", name)])
    # The annotations the rank-0 wrapper serialises a broadcast by are upstream's
    for name, method in upstream.items():
        monkeypatch.setattr(backend.JaxBackendImpl, name, method)
    ranks.freed_memory_returned()
    for name in ranks.RETURNS_FREED_MEMORY:
        wrapped = getattr(backend.JaxBackendImpl, name)
        assert wrapped.returns_freed_memory
        assert typing.get_type_hints(wrapped) == typing.get_type_hints(upstream[name])
