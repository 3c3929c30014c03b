"""The package's rooms follow the data flow — capture → replay → metrics → report → plot — with the
reference mathematics and kernels below them: no module imports a room downstream of its own, at
module level or inside a function. Read from the source (ast), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "osdn_diag"

#: Each room may import only the rooms listed (and itself). Top-level helper modules (names starting
#: with "_") are available to every room; ``rundir`` (what a run directory is: ids, stages, locks,
#: hashes) is infrastructure below every room that writes files, and imports none of them; ``runtime``
#: (where kernels run: the CPU interpreter, devices) is the same below every room that runs a model.
ALLOWED = {
    "rundir": set(),
    "runtime": set(),
    "catalog": set(),  # names only: no torch, no fla, no other room
    "math": set(),
    "ops": {"math"},
    "capture": {"math", "ops", "rundir", "runtime"},
    "metrics": {"math", "ops", "capture"},  # the record type it reads
    "replay": {"capture", "metrics", "math", "ops", "prompts", "rundir"},
    "report": {"replay", "capture", "metrics", "math", "rundir", "whatif"},
    "plot": {"report", "replay", "capture"},
    "view": {"report", "replay", "capture"},  # reads finished runs, as plot does; nothing imports it
}

#: Imports against the flow, each allowed for the reason given: ``(file, room it imports)``.
EXCEPTIONS = {
    # Results.view() is a convenience for the notebook: it imports the view lazily, inside the method,
    # so replay never needs plotly and the view's modules never load unless it is called.
    ("osdn_diag/replay/results.py", "view"): "Results.view(), a lazy import inside the method",
}


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
                if (other and other != room and not other.startswith("_") and other not in allowed
                        and (str(path.relative_to(PACKAGE.parent)), other) not in EXCEPTIONS):
                    problems.append(f"{path.relative_to(PACKAGE.parent)} imports {name} ({room} -> {other})")
    assert not problems, "\n".join(sorted(set(problems)))


def test_nothing_upstream_imports_the_view():
    """Only the listed exceptions reach the view from a room upstream of it."""
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        if rel.startswith("osdn_diag/view/"):
            continue
        if any(_room(name) == "view" for name in _imports(path)):
            found.add(rel)
    assert found <= {f for f, room in EXCEPTIONS if room == "view"} | {"osdn_diag/cli.py", "osdn_diag/demo.py"}, found
