"""The run says what the engine compiles while it compiles, whether it was compiled or loaded from the machine's
cache, and how long it took here before; the report gets each program's seconds: rank 0's log read as the engine's
console logger writes it (wrapped lines, arriving in pieces)."""

from __future__ import annotations

import logging

import pytest

from txflow.cluster import compiles
from txflow.cluster.compiles import CompileWatch
from txflow.cluster.records import Cluster, ProcessRecord

# How upstream's rich handler writes the lines: padded to 80 columns, wrapped at a space.
WRAPPED = ("2026-12-02 23:25:21,433 - INFO - tx: JIT compiling for sample seq_len=32 in     \n"
           "progress...                                                                     \n"
           "2026-12-02 23:25:44,890 - INFO - tx: JIT compilation for sample seq_len=32 took \n"
           "23.46s                                                                          \n"
           "2026-12-02 23:25:53,346 - INFO - tx: JIT compiling for train seq_len=64 in      \n"
           "progress...                                                                     \n")
LATER = ("2026-12-02 23:26:18,038 - INFO - tx: JIT compilation for train seq_len=64 took  \n"
         "24.69s (compiling 18.20s; persistent cache: 1 of 3 loaded, 0.4s of compiling  \n"
         "saved)                                                                          \n"
         "2026-12-02 23:26:18,100 - INFO - tx: JIT compiling for optimizer seq_len=0 in progress...\n"
         "2026-12-02 23:26:30,100 - INFO - tx: JIT compilation for optimizer seq_len=0 took 3.20s \n"
         "(compiling 0.90s; persistent cache: 2 of 2 loaded, 10.1s of compiling saved)\n")


@pytest.fixture(autouse=True)
def machine_cache(tmp_path, monkeypatch):
    """A cache directory of the test's own: what the machine compiled before is kept there."""
    monkeypatch.setenv("TXFLOW_CACHE", str(tmp_path / "cache"))


def watch_of(tmp_path) -> tuple[CompileWatch, object]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "rank0.log"
    log.write_text("")
    cluster = Cluster(run_id="c", launcher="local", state_dir=str(tmp_path), host="127.0.0.1", api_port=1,
                      coordinator_port=None, num_processes=1, base_model_path="x", checkpoints_base="y",
                      processes=[ProcessRecord(role="coordinator", rank=0, pid=1, host="h", log=str(log))])
    return CompileWatch(cluster), log


def test_each_program_is_announced_when_it_starts_and_timed_when_it_is_ready(tmp_path, caplog):
    watch, log = watch_of(tmp_path)
    caplog.set_level(logging.INFO, logger="txflow")
    text = WRAPPED + LATER
    cut = text.index("23.46") + 3  # a read that ends inside a figure
    within = text.index("2 of 2") + 3  # ... and one inside the cache's note
    for piece in (text[:cut], text[cut:len(WRAPPED)], LATER[:40], text[len(WRAPPED) + 40:within], text[within:]):
        with open(log, "a") as f:
            f.write(piece)
        watch.poll()
    watch.stop()
    said = [r.getMessage() for r in caplog.records]
    first = "(the first time on this machine: XLA compiles it once, later runs load it from the cache)"
    assert said == [
        f"compiling the sample program for prompts of 32 tokens {first}",
        "the sample 32 program is ready after 23.5 s",  # an engine that did not say what the cache did
        f"compiling the train program for sequences of 64 tokens {first}",
        "the train 64 program is ready after 24.7 s: compiled in 18.2 s, the rest was its first run (later runs on "
        "this machine load it from the cache)",
        f"compiling the optimizer program for the adapters {first}",
        "the optimizer program is ready after 3.2 s: loaded from this machine's cache in 0.9 s (compiling it took "
        "11.0 s)",
    ]
    # The report's figure is what went to making each program, not its first run (the whole call when the engine
    # did not say).
    assert watch.timings() == {"compile sample 32": 23.46, "compile train 64": 18.2, "compile optimizer": 0.9}
    # The next run on this machine says how long it may wait: what compiling each program took here.
    assert compiles.recorded("x") == {"train 64": 18.2, "optimizer": 11.0}  # a load: 10.1 s saved + 0.9 s
    caplog.clear()
    again, log = watch_of(tmp_path / "again")
    log.write_text(WRAPPED[len(WRAPPED) - 160:])  # the train program starting
    again.poll()
    assert [r.getMessage() for r in caplog.records] == [
        "compiling the train program for sequences of 64 tokens, or loading it from this machine's cache "
        "(compiling it took ~18 s here)"]


def test_an_attached_run_says_nothing_of_what_compiled_before_it(tmp_path, caplog):
    watch, log = watch_of(tmp_path)
    log.write_text(WRAPPED)
    watch.skip_past()
    caplog.set_level(logging.INFO, logger="txflow")
    with open(log, "a") as f:
        f.write(LATER)
    watch.poll(final=True)
    assert watch.timings() == {"compile train 64": 18.2, "compile optimizer": 0.9}  # the end of one it saw begin
