"""What the engine is compiling, read from rank 0's log, so that a run is never silent while XLA works.

A real model's first request of each shape waits for XLA: seconds to a minute on a CPU, and nothing else
moves meanwhile. The engine logs each program it compiles (`JIT compiling for <program> seq_len=<n> in
progress...`, then `... took <s>s`; upstream's lines, written for every shape of a train, forward or sample
program and for the optimizer by `txflow.upstream.skyrl_tx.ranks`, which adds how much of that first call went to
making the program and how many of its executables came from JAX's persistent cache); this watcher turns them
into the run's own log lines and adds up each program's compile seconds for the report's `timings_s` (`compile
<program> <n>`): tracing, lowering, XLA's compile or the cache's load, not the program's first run. What a program
took to compile on this machine is kept (`COMPILE_RECORD` in txflow's cache), so that a later run says how long it
may wait."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

from txflow.cluster.records import Cluster
from txflow.log import get_logger

STARTED = re.compile(r"JIT compiling for (\w+) seq_len=(\d+) in progress")
# The end line's note, when the engine counts JAX's events: the seconds of the first call that went to making the
# program (`compiling`; the rest is its first run), then what the persistent cache held, when it is on.
FINISHED = re.compile(r"JIT compilation for (\w+) seq_len=(\d+) took ([0-9.]+)s(?: \(compiling ([0-9.]+)s(?:; "
                      r"persistent cache: (\d+) of (\d+) loaded, ([0-9.]+)s of compiling saved)?\))?")
UNITS = {"train": "sequences of {n} tokens", "forward": "sequences of {n} tokens", "sample": "prompts of {n} tokens",
         "optimizer": "the adapters"}


COMPILE_RECORD = "compile-seconds.json"
"""In txflow's cache: per base model (its directory's name), what each program took to compile on this machine."""


def record_path() -> Path:
    from txflow.upstream.tiny_model import cache_dir

    return cache_dir() / COMPILE_RECORD


def recorded(model: str) -> dict[str, float]:
    """What each program of `model` took to compile here before ({} when nothing is known)."""
    try:
        return dict(json.loads(record_path().read_text()).get(model, {}))
    except (OSError, ValueError, AttributeError):
        return {}


def record(model: str, name: str, seconds: float) -> None:
    """Keep what compiling `name` took, for the next run's message; a record that cannot be written is skipped."""
    path = record_path()
    try:
        known = json.loads(path.read_text()) if path.is_file() else {}
        known.setdefault(model, {})[name] = round(seconds, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(known, indent=1, sort_keys=True))
        partial.replace(path)
    except (OSError, ValueError, AttributeError):
        pass


def program_name(kind: str, length: str) -> str:
    """`train 64`, `sample 32`, `optimizer`: how the log and the report name a program."""
    return kind if kind == "optimizer" else f"{kind} {length}"


class CompileWatch:
    """Follows rank 0's log (on this node) from a thread of its own; `seconds` holds what it saw compile."""

    def __init__(self, cluster: Cluster, interval_s: float = 0.5):
        self.cluster = cluster
        self.model = Path(cluster.base_model_path).name  # its directory's name: a model and its conversion
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
        self.poll(final=True)  # what the log said last

    def timings(self) -> dict[str, float]:
        """The report's entries: `compile <program>` -> seconds, for every program seen compiling."""
        return {f"compile {name}": seconds for name, seconds in self.seconds.items()}

    def poll(self, final: bool = False) -> None:
        """Read what rank 0 logged since the last poll and say what started or finished compiling (`final`: the
        log will not grow, so a line is whole as it stands)."""
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
            if match.re is FINISHED and match.group(4) is None and not final and self._unfinished(text[match.end():]):
                break  # what the cache did may still be on its way: read the line again next time
            name = program_name(match.group(1), match.group(2))
            if match.re is STARTED:
                get_logger().info(self.starting(match.group(1), match.group(2), name))
            else:
                took = float(match.group(3))
                compiling = took if match.group(4) is None else float(match.group(4))
                self.seconds[name] = round(self.seconds.get(name, 0.0) + compiling, 3)
                get_logger().info(self.ready(name, took, match))
            consumed = match.end()
        # Keep an unfinished line for the next poll (a wrapped line may arrive in two reads), not the rest.
        self._pending = text[consumed:][-400:]

    @staticmethod
    def _unfinished(rest: str) -> bool:
        """Whether the text after a compile's end line may still become its note."""
        start = " (compiling"
        return rest.startswith(start) or start.startswith(rest)

    def starting(self, kind: str, length: str, name: str) -> str:
        what = f"the {kind} program for {UNITS.get(kind, '{n}').format(n=length)}"
        before = recorded(self.model).get(name)
        if before is None:
            return f"compiling {what} (the first time on this machine: XLA compiles it once, later runs load it " \
                   f"from the cache)"
        return f"compiling {what}, or loading it from this machine's cache (compiling it took ~{before:.0f} s here)"

    def ready(self, name: str, took: float, match: re.Match) -> str:
        said = f"the {name} program is ready after {took:.1f} s"
        if match.group(4) is None:  # the engine did not say what went to compiling
            return said
        compiling = float(match.group(4))
        if match.group(5) is None:  # JAX's persistent cache is off: every program compiles
            return f"{said}: compiled in {compiling:.1f} s, the rest was its first run"
        found, asked, saved = int(match.group(5)), int(match.group(6)), float(match.group(7))
        if found == asked:
            # Loaded: compiling it took what the load saved (XLA's compile, as JAX recorded it) and the tracing and
            # lowering that came before it here too; the same measure as a compiled program's.
            took_before = saved + compiling
            record(self.model, name, took_before)
            return f"{said}: loaded from this machine's cache in {compiling:.1f} s (compiling it took " \
                   f"{took_before:.1f} s)"
        record(self.model, name, compiling)
        return f"{said}: compiled in {compiling:.1f} s, the rest was its first run (later runs on this machine " \
               f"load it from the cache)"

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except OSError:
                pass  # a log rotated or removed under us: nothing to say
