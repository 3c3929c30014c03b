"""The mutation list (``tools/mutations.toml``) stays applicable as the code moves, and the mutation
tool (``tools/mutate.py``) runs the copy's code.

The list checks are cheap (text only). One test runs the tool on one mutation of ``proofs/`` — the
folder that reaches Python as ``osdn_diag.proofs`` only through the install's mapping — and sees
the copy's tests fail on it, and a mutation that raises at import reported as a trivial catch.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mutate():
    """``tools/mutate.py`` as a module (``tools/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("osdn_mutate_tool", ROOT / "tools" / "mutate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture(scope="module")
def mutations(mutate):
    return mutate.load_mutations(ROOT / "tools" / "mutations.toml")


def test_the_list_parses_with_unique_ids(mutations):
    ids = [m.id for m in mutations]
    assert len(ids) >= 25
    assert len(set(ids)) == len(ids)
    assert all(m.description and m.tests and m.edits for m in mutations)


def test_every_snippet_occurs_exactly_once_and_changes_something(mutate, mutations):
    problems = {m.id: p for m in mutations if (p := mutate.mutation_problems(ROOT, m))}
    assert not problems, "mutations that no longer apply (update tools/mutations.toml):\n" + "\n".join(
        f"  {mid}: {'; '.join(p)}" for mid, p in problems.items()
    )
    for m in mutations:
        assert all(e.new != e.old for e in m.edits), m.id


def test_every_named_test_exists(mutate, mutations):
    problems = [f"{m.id}: {p}" for m in mutations for t in m.tests if (p := mutate.test_target_problem(ROOT, t))]
    assert not problems, "\n".join(problems)


def _write(tmp_path, body: str) -> Path:
    path = tmp_path / "list.toml"
    path.write_text(body, encoding="utf-8")
    return path


ENTRY = """
[[mutation]]
id = "{id}"
description = "d"
file = "osdn_diag/runtime/strict_json.py"
old = '{old}'
new = '{new}'
tests = ["{test}"]
"""


def test_the_checks_can_fail(mutate, tmp_path):
    """A repeated id and a missing field are refused by the loader; a snippet found twice or not at
    all, an edit that changes nothing and a test that does not exist are reported."""
    ok = ENTRY.format(id="a", old="from __future__ import annotations", new="x", test="tests/test_packaging.py")
    with pytest.raises(mutate.MutationListError, match="used twice"):
        mutate.load_mutations(_write(tmp_path, ok + ok))
    with pytest.raises(mutate.MutationListError, match="missing tests"):
        mutate.load_mutations(_write(tmp_path, ok.replace('tests = ["tests/test_packaging.py"]', "")))

    (m,) = mutate.load_mutations(_write(tmp_path, ok))
    assert mutate.mutation_problems(ROOT, m) == []
    for old, new, why in (("import", "x", "occurs"), ("no such text", "x", "occurs 0 times"),
                          ("from __future__ import annotations", "from __future__ import annotations", "equals")):
        (bad,) = mutate.load_mutations(_write(tmp_path, ENTRY.format(id="b", old=old, new=new, test="x")))
        (problem,) = mutate.mutation_problems(ROOT, bad)
        assert why in problem
    assert mutate.test_target_problem(ROOT, "tests/test_packaging.py::test_every_subpackage_is_listed") is None
    assert "no such" in mutate.test_target_problem(ROOT, "tests/no_such_test.py")
    assert "not defined" in mutate.test_target_problem(ROOT, "tests/test_packaging.py::test_gone[1]")


def test_pytest_outcomes_are_classified(mutate):
    out = "FAILED tests/a.py::test_x[1] - AssertionError: no\nFAILED tests/a.py::test_y\n1 failed"
    assert mutate.classify(1, out) == ("caught", "tests/a.py::test_x[1]")
    assert mutate.classify(0, "3 passed")[0] == "survived"
    collection = "E   ModuleNotFoundError: No module named 'x'\nERROR tests/b.py\nInterrupted: 1 error during collection"
    result, detail = mutate.classify(2, collection)
    assert result == "caught (collection)" and "ModuleNotFoundError" in detail and "tests/b.py" in detail
    assert mutate.classify(5, "no tests ran")[0] == "broken"
    assert mutate.classify(None, "")[0] == "timeout"


def test_the_copy_runs_its_own_proofs(mutate, tmp_path):
    """In the copy, ``osdn_diag.proofs`` is the copy's ``proofs/``: an edit there fails the copy's
    test (not a collection error, not a pass), and an edit that raises at import is seen."""
    body = """
[[mutation]]
id = "detail-dropped"
description = "d"
file = "proofs/ledger.py"
old = 'outcome = Outcome(f"{type(exc).__name__}: {exc}")'
new = 'outcome = Outcome(type(exc).__name__)'
tests = ["tests/proofs/test_ledger.py::test_exception_becomes_failed"]

[[mutation]]
id = "raises-at-import"
description = "d"
file = "proofs/_claims.py"
old = 'ESTABLISHED = ("verified", "refuted", "conditional")'
new = 'raise RuntimeError("planted at import")'
tests = ["tests/proofs/test_ledger.py::test_exception_becomes_failed"]
"""
    edited, raising = mutate.load_mutations(_write(tmp_path, body))
    files = mutate.source_files(ROOT)
    settings = mutate.Settings(timeout=600)
    out = mutate.run_mutation(edited, files, settings)
    assert (out.result, out.detail) == ("caught", "tests/proofs/test_ledger.py::test_exception_becomes_failed"), out.log[-2000:]
    out = mutate.run_mutation(raising, files, settings)
    assert out.result == "caught (import)" and "planted at import" in out.detail, out.detail
