"""What the engine is compiling, read from rank 0's log, so that a run is never silent while XLA works.

A real model's first request of each shape waits for XLA: seconds to a minute on a CPU, and nothing else
moves meanwhile. The engine logs each program it compiles (`JIT compiling for <program> seq_len=<n> in
progress...`, then `... took <s>s`; upstream's lines, written for every shape of a train, forward or sample
program and for the optimizer by `txflow.upstream.skyrl_tx.ranks`); this watcher turns them into the run's own
log lines and adds up each program's seconds for the report's `timings_s` (`compile <program> <n>`)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

from txflow.cluster.records import Cluster
from txflow.log import get_logger

STARTED = re.compile(r"JIT compiling for (\w+) seq_len=(\d+) in progress")
FINISHED = re.compile(r"JIT compilation for (\w+) seq_len=(\d+) took ([0-9.]+)s")
UNITS = {"train": "sequences of {n} tokens", "forward": "sequences of {n} tokens", "sample": "prompts of {n} tokens",
         "optimizer": "the adapters"}


def program_name(kind: str, length: str) -> str:
    """`train 64`, `sample 32`, `optimizer`: how the log and the report name a program."""
    return kind if kind == "optimizer" else f"{kind} {length}"


class CompileWatch:
    """Follows rank 0's log (on this node) from a thread of its own; `seconds` holds what it saw compile."""

    def __init__(self, cluster: Cluster, interval_s: float = 0.5):
        self.cluster = cluster
        self.interval_s = interval_s
        self.seconds: dict[str, float] = {}
        self._offset = 0
        self._pending = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"compile-watch-{cluster.run_id}", daemon=True)

    def start(self) -> CompileWatch:
        self._thread.start()
        return self

    def skip_past(self) -> None:
        """Say nothing of what the log already holds (a shared cluster's earlier compiles are not this run's)."""
        engine = next((p for p in list(self.cluster.processes) if p.role == "coordinator"), None)
        if engine is not None and Path(engine.log).is_file():
            self._offset = Path(engine.log).stat().st_size

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.poll()  # what the log said last

    def timings(self) -> dict[str, float]:
        """The report's entries: `compile <program>` -> seconds, for every program seen compiling."""
        return {f"compile {name}": seconds for name, seconds in self.seconds.items()}

    def poll(self) -> None:
        """Read what rank 0 logged since the last poll and say what started or finished compiling."""
        engine = next((p for p in list(self.cluster.processes) if p.role == "coordinator"), None)
        if engine is None or not Path(engine.log).is_file():
            return  # not started yet, or its log lives on another node
        with open(engine.log, "rb") as log:
            log.seek(self._offset)
            chunk = log.read()
        self._offset += len(chunk)
        # The engine's console logger wraps long lines: whitespace runs, newlines included, are one space.
        text = re.sub(r"\s+", " ", self._pending + chunk.decode(errors="replace"))
        consumed = 0
        for match in sorted([*STARTED.finditer(text), *FINISHED.finditer(text)], key=lambda m: m.start()):
            name = program_name(match.group(1), match.group(2))
            if match.re is STARTED:
                what = UNITS.get(match.group(1), "{n}").format(n=match.group(2))
                get_logger().info(f"compiling the {match.group(1)} program for {what} (XLA, once per shape; "
                                  f"later runs on this machine load it from the cache)")
            else:
                self.seconds[name] = round(self.seconds.get(name, 0.0) + float(match.group(3)), 3)
                get_logger().info(f"the {name} program is ready after {float(match.group(3)):.1f} s")
            consumed = match.end()
        # Keep an unfinished line for the next poll (a wrapped line may arrive in two reads), not the rest.
        self._pending = text[consumed:][-400:]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except OSError:
                pass  # a log rotated or removed under us: nothing to say
