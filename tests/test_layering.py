"""The folders show the architecture: every module imports only its own room and the floors below it,
and no modules import each other in a circle.

The order of the rooms is written once, here (`FLOORS`); docs/development.md's Layout section is its map.
Every import counts, those inside functions included (they run too, later).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("txflow", "tasks", "flows", "deployments")

# From the ground up. A module may import modules of its own room and of rooms on lower floors, never
# a room on its own floor or above. A room is a name and everything under it; `tasks.*` makes each
# pipeline step a room of its own (steps hand each other typed results, never functions).
FLOORS: list[tuple[str, ...]] = [
    ("txflow", "txflow.config", "txflow.log", "txflow.data"),  # the run's contract, logging with redaction
    ("txflow.processes",),  # process groups, /proc, ports, logs, the lifeline
    ("txflow.upstream",),  # SkyRL-tx and the Tinker SDKs: every patch, named in one table
    ("txflow.checkpoints",),  # markers, durable storage, discovery, leases, promotion pointers, the export's records
    ("txflow.cluster",),  # cluster.json, launchers, handle, monitor, the embedded Prefect server
    ("txflow.results",),  # what the steps hand each other, and the run's progress
    ("txflow.reporting",),  # report.json, metrics, the training bar, the nightly history
    # the loop, the checkpoints it saves, the restore check and the verdict; what becomes of a run's artifacts
    # (discover, export: the room that loads models in transformers + peft, prune, promote)
    ("txflow.training", "txflow.artifacts"),
    ("txflow.serving",),  # `txflow serve`: OpenAI's text API over what a run trained, on a warm cluster
    ("txflow.preflight",),
    ("tasks.*",),
    ("flows",),
    ("txflow.cli", "deployments"),
]


def find_modules(root: Path) -> dict[str, Path]:
    """{dotted name: file} of every module of the first-party packages under `root`."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a module of ours (`a.b.C` -> `a.b` when C is a name in it)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in (_known(target, modules) for target in targets) if t)
    return found - {name}


def room_of(module: str) -> tuple[int, str] | None:
    """(floor, room) of a module: its longest matching entry in FLOORS (None when it has none)."""
    best = None
    for floor, entries in enumerate(FLOORS):
        for entry in entries:
            prefix = entry.removesuffix(".*")
            if module == prefix or module.startswith(prefix + "."):
                room = module if entry.endswith(".*") else entry
                if best is None or len(prefix) > best[2]:
                    best = (floor, room, len(prefix))
    if best is None or (best[1] == "txflow" and module != "txflow"):
        return None  # a new top-level module of txflow must be placed on a floor by name
    return best[0], best[1]


def layering_problems(root: Path) -> list[str]:
    """Every module without a room, every import into a room that is not below, and every circle."""
    modules = find_modules(root)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    problems = [f"{name} is on no floor: add it to FLOORS in tests/test_layering.py"
                for name in modules if room_of(name) is None]
    for name, targets in sorted(graph.items()):
        here = room_of(name)
        for target in sorted(targets):
            there = room_of(target)
            if here is None or there is None or here[1] == there[1]:
                continue
            if there[0] >= here[0]:
                where = "its own floor" if there[0] == here[0] else "a higher floor"
                problems.append(f"{name} (room {here[1]}, floor {here[0]}) imports {target}, on {where} "
                                f"(room {there[1]}, floor {there[0]})")
    problems += [f"import circle: {' -> '.join(circle)}" for circle in circles(graph)]
    return problems


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_import_runs_down_the_floors_and_none_in_a_circle():
    assert layering_problems(REPO) == []


def thick_steps(root: Path) -> list[str]:
    """Every pipeline step that reaches into the SkyRL-tx adapter itself: a step wraps a call into txflow's
    rooms, which know the adapter (`tasks/` stays thin)."""
    modules = find_modules(root)
    return [f"{name} imports {target}: a step calls txflow's rooms, never txflow.upstream"
            for name, path in sorted(modules.items()) if name.startswith("tasks.")
            for target in sorted(imports_of(name, path, modules)) if target.startswith("txflow.upstream")]


def test_no_step_imports_the_upstream_adapter():
    assert thick_steps(REPO) == []


def test_upstream_imports_only_processes_config_and_log():
    modules = find_modules(REPO)
    allowed = ("txflow.upstream", "txflow.processes", "txflow.config", "txflow.log")
    for name, path in modules.items():
        if name.startswith("txflow.upstream"):
            outside = [t for t in imports_of(name, path, modules) if not t.startswith(allowed)]
            assert outside == [], f"{name} imports {outside}"


def _write(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)


def test_the_check_finds_an_upward_import_a_sideways_one_a_step_borrowing_from_a_step_a_thick_step_and_a_circle(
        tmp_path):
    _write(tmp_path, {
        "txflow/__init__.py": "",
        "txflow/config.py": "",
        "txflow/processes/__init__.py": "",
        "txflow/processes/groups.py": "def later():\n    from txflow.cluster import handle\n",  # upward
        "txflow/cluster/__init__.py": "",
        "txflow/cluster/handle.py": "from ..processes import groups\n",  # relative, resolved: a circle
        "txflow/training/__init__.py": "",
        "txflow/reporting/__init__.py": "",
        "txflow/reporting/report.py": "from txflow.config import RunConfig\n",
        "txflow/results.py": "from txflow.reporting.report import build\n",  # upward
        "deployments/__init__.py": "",
        "deployments/nightly.py": "from txflow.cli import main\n",  # sideways, same floor
        "txflow/cli.py": "",
        "txflow/stray.py": "",  # on no floor
        "tasks/__init__.py": "",
        "tasks/save_checkpoint.py": "from tasks.train import training_client_at\n",  # a step borrowing
        "tasks/train.py": "from txflow.config import RunConfig\nfrom txflow.upstream.skyrl_tx import losses\n",
        "txflow/upstream/__init__.py": "",
        "txflow/upstream/skyrl_tx/__init__.py": "",
        "txflow/upstream/skyrl_tx/losses.py": "",
    })
    problems = "\n".join(layering_problems(tmp_path))
    assert "txflow.processes.groups (room txflow.processes, floor 1) imports txflow.cluster.handle, on a higher " \
           "floor" in problems
    assert "txflow.results (room txflow.results, floor 5) imports txflow.reporting.report, on a higher floor" \
           in problems
    assert "deployments.nightly (room deployments, floor 12) imports txflow.cli, on its own floor" in problems
    assert "tasks.save_checkpoint (room tasks.save_checkpoint, floor 10) imports tasks.train, on its own floor" \
           in problems
    assert "import circle: txflow.cluster.handle -> txflow.processes.groups" in problems
    assert "txflow.stray is on no floor" in problems
    assert len(problems.splitlines()) == 6, problems  # and nothing else: downward imports are fine
    # tasks.train's import of the adapter runs down the floors, and is still a step that is not thin.
    assert thick_steps(tmp_path) == ["tasks.train imports txflow.upstream.skyrl_tx.losses: a step calls "
                                     "txflow's rooms, never txflow.upstream"]
