"""The package's rooms follow the data flow — capture → replay → metrics → report → plot — with the
reference mathematics and kernels below them: no module imports a room downstream of its own, at
module level or inside a function. Read from the source (ast), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "osdn_diag"

#: Each room may import only the rooms listed (and itself). ``runtime`` (the plumbing: where kernels run,
#: caches, atomic files, input checks) is below every room and available to all; it imports none of
#: them. ``rundir`` (what a run directory is: ids, stages, locks, hashes) is infrastructure below every
#: room that writes files. ``cli`` sits on top and may import any room.
ALLOWED = {
    "runtime": set(),
    "rundir": set(),
    "catalog": set(),  # names only: no torch, no fla, no other room
    "math": set(),
    "ops": {"math"},
    "layers": {"ops", "math"},
    "models": {"catalog", "layers", "ops", "math"},
    "prompts": set(),
    "capture": {"math", "ops", "rundir"},
    "metrics": {"math", "ops", "capture"},  # the record type it reads
    "replay": {"capture", "metrics", "math", "ops", "prompts", "rundir"},
    "identity": {"rundir"},
    "pipeline": {"capture", "distributed", "identity", "models", "prompts", "replay", "metrics", "math", "ops",
                 "rundir"},
    "whatif": {"capture", "math", "metrics", "pipeline", "replay", "rundir"},
    "report": {"replay", "capture", "metrics", "math", "rundir", "whatif"},
    "plot": {"report", "replay", "capture"},
    "merge": {"capture", "replay", "report", "rundir"},
    "demo": {"catalog", "pipeline", "replay", "report", "rundir", "view"},
    "view": {"report", "replay", "capture", "rundir"},  # reads finished runs, as plot does; nothing upstream imports it (rundir: its page is never one of a run's own files)
    "monitor": {"capture", "replay", "metrics", "rundir"},  # a training loop's probes: capture and replay, in memory (rundir: the lock of a shared monitor.parquet)
}

#: Imports against the flow, each allowed for the reason given: ``(file, room it imports)``.
EXCEPTIONS = {
    # Results.view() is a convenience for the notebook: it imports the view lazily, inside the method,
    # so replay never needs plotly and the view's modules never load unless it is called.
    ("osdn_diag/replay/results.py", "view"): "Results.view(), a lazy import inside the method",
}
#: What the package root holds besides the rooms: the package itself and ``python -m osdn_diag``.
ROOT_MODULES = {"__init__.py", "__main__.py"}


def _room(module: str) -> str:
    """``osdn_diag.replay.call`` -> ``replay``; ``osdn_diag.plot`` -> ``plot``."""
    return module.split(".")[1] if module.count(".") >= 1 else ""


def _imports(path: Path) -> set[str]:
    """Every osdn_diag module that ``path`` imports, anywhere in the file, as absolute names."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    package = parts if path.name == "__init__.py" else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("osdn_diag"):
                found.add(name)
                found.update(f"{name}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("osdn_diag"))
    return found


def test_rooms_import_only_upstream():
    problems = []
    for room, allowed in ALLOWED.items():
        files = [PACKAGE / f"{room}.py"] if (PACKAGE / f"{room}.py").exists() else sorted((PACKAGE / room).rglob("*.py"))
        assert files, room
        for path in files:
            for name in _imports(path):
                other = _room(name)
                below = other == "runtime" and room != "runtime"  # plumbing, open to every room
                excepted = (str(path.relative_to(PACKAGE.parent)), other) in EXCEPTIONS
                if other and other != room and not below and not excepted and other not in allowed:
                    problems.append(f"{path.relative_to(PACKAGE.parent)} imports {name} ({room} -> {other})")
    assert not problems, "\n".join(sorted(set(problems)))


def test_the_root_shows_the_stages():
    """The package root holds the rooms of the data flow and nothing private: plumbing lives in
    ``runtime/``, the command line's parts in ``cli/``."""
    private = sorted(p.name for p in PACKAGE.glob("_*.py") if p.name not in ROOT_MODULES)
    assert not private, f"plumbing modules at the package root (move them into runtime/): {private}"
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {p.stem for p in PACKAGE.glob("*.py") if p.name not in ROOT_MODULES}
    unlisted = sorted(rooms - set(ALLOWED) - {"cli", "distributed", "builtin", "tuning", "proofs"})
    assert not unlisted, f"rooms without a rule in ALLOWED: {unlisted}"


def _module_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports (anywhere in the file), edges to
    a module's own enclosing packages left out (a submodule may use its package's namespace)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    graph = {}
    for name, path in modules.items():
        deps = set()
        for imported in _imports(path):
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:  # a name imported from a module
                parts = parts[:-1]
            target = ".".join(parts)
            if target and target != name and not name.startswith(target + ".") and not target.startswith(name + "."):
                deps.add(target)
        graph[name] = deps
    return graph


def test_no_import_cycles():
    """No two modules import each other, directly or through others, even inside functions: each
    module can be read, and tested, above the ones it uses."""
    graph = _module_graph()
    seen, stack, cycles = {}, [], []

    def visit(module: str) -> None:  # depth-first; a grey node met again closes a cycle
        seen[module] = "grey"
        stack.append(module)
        for dep in sorted(graph[module]):
            if seen.get(dep) == "grey":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in seen:
                visit(dep)
        stack.pop()
        seen[module] = "black"

    for module in sorted(graph):
        if module not in seen:
            visit(module)
    assert not cycles, "\n".join(cycles)


def test_nothing_upstream_imports_the_view():
    """Only the listed exceptions reach the view from a room upstream of it (the command line and
    the demo sit above it)."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        if rel.startswith(("osdn_diag/view/", "osdn_diag/cli/")):
            continue
        if any(_room(name) == "view" for name in _imports(path)):
            found.add(rel)
    assert found <= {f for f, room in EXCEPTIONS if room == "view"} | {"osdn_diag/demo.py"}, found
