"""Every proof step must be able to fail: each step of every claim is a :class:`Check` whose own
perturbation (:meth:`Check.can_fail`) makes it fail; a perturbed constant, passed through the proof's own
parameter, turns its verdict to ``failed``; and the proofs that run are those of the tree whose
``osdn_diag`` is imported.
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction
from pathlib import Path

import pytest
import sympy as sp

import osdn_diag
from osdn_diag.proofs import comparator_gap, ledger, theorem_d5
from osdn_diag.proofs._evidence import Conditional, Derivation
from osdn_diag.proofs._sym import Check, all_vanish, holds_on, is_nonnegative, is_nonzero, relation, vanishes

PROOFS = Path(__file__).resolve().parents[2] / "proofs"


def test_proofs_come_from_the_imported_tree():
    """``osdn_diag.proofs`` is the ``proofs/`` folder beside the imported ``osdn_diag`` (a source checkout),
    not the one an editable install maps the name to."""
    import osdn_diag.proofs as proofs
    import osdn_diag.proofs.ledger as ledger_module

    root = Path(osdn_diag.__file__).resolve().parents[1]
    assert Path(proofs.__file__).resolve() == root / "proofs" / "__init__.py"
    assert Path(ledger_module.__file__).resolve() == root / "proofs" / "ledger.py"
    assert root / "proofs" == PROOFS


# --- Theorem D.5: the Rayleigh constant 2L -----------------------------------------------------------


@pytest.mark.parametrize("T", [1, 2])
def test_chain_steps_fail_with_constant_L(T):
    good, bad = theorem_d5.chain_steps(T), theorem_d5.chain_steps(T, rayleigh=1)
    assert all(v.ok for v in good.values()), good
    failed = [name for name, v in bad.items() if not v.ok]
    assert len(failed) == T and all("1L·gap − r_t" in name for name in failed), failed


@pytest.mark.parametrize("check", [theorem_d5.check_lemma_d3, theorem_d5.check_term_by_term,
                                   theorem_d5.check_theorem_d5], ids=lambda f: f.__name__)
@pytest.mark.parametrize("constant", [1, 3])
def test_theorem_d5_verdict_flips_with_the_rayleigh_constant(check, constant):
    assert check().status == "verified"
    outcome = check(rayleigh=constant)
    assert outcome.status == "failed"
    assert f"{constant}L" in outcome.detail


def test_rayleigh_step_by_hand():
    """2L·(f(S) − f*) − ‖g‖² = μδb, evaluated at numbers (L = 3 = μ + δ, μ = 1, a = 2, b = 5)."""
    mu, delta, a, b = 1, 2, 2, 5
    L = mu + delta
    excess, g2 = Fraction(L * a + mu * b, 2), L**2 * a + mu**2 * b
    assert 2 * L * excess - g2 == mu * delta * b
    assert L * excess - g2 != mu * delta * b  # the perturbed constant
    assert excess / g2 >= Fraction(1, 2 * L)


# --- App. D.3: the box gap's sign ------------------------------------------------------------------


@pytest.mark.parametrize("T,K", [(1, 1), (2, 2)])
def test_box_gap_steps_fail_with_the_wrong_sign(T, K):
    assert all(v.ok for v in comparator_gap.box_gap_steps(T, K).values())
    bad = comparator_gap.box_gap_steps(T, K, box_sign=-1)
    assert [v.ok for v in bad.values()] == [False, True]  # the identity fails, the square sum stays


def test_decomposition_verdict_flips_with_the_box_gap_sign():
    assert comparator_gap.check_decomposition().status == "verified"
    outcome = comparator_gap.check_decomposition(box_sign=-1)
    assert outcome.status == "failed" and "-1·(H(d) − H(d*))" in outcome.detail


def test_box_gap_instances_record_their_numbers():
    """h(d) = −d + ½σd² with σ = E k² = 1: d* = 1 inside [1/2, 2], min −1/2 on both; under (18) with
    β = 1/4: min over R −1/2 at d = 4, over [1/2, 2] at d = 2: ((1 − 1/2)² − 1)/2 = −3/8."""
    inside = comparator_gap.population_box_instance()
    assert (inside.instance["d*"], inside.instance["min over R"], inside.instance["min over box"]) == ("1", "-1/2", "-1/2")
    assert inside.holds is True
    outside = comparator_gap.box_gap_example()
    assert (outside.instance["min over R"], outside.instance["min over box"]) == ("-1/2", "-3/8")
    assert ((1 - Fraction(1, 4) * 2) ** 2 - 1) / 2 == Fraction(-3, 8)
    # σ = 4 puts d* = 1/4 below the box: best −1/8 over R, 0 at d = 1/2; no longer a zero gap
    below = comparator_gap.population_box_instance(keys=(2, 2))
    assert (below.instance["min over R"], below.instance["min over box"]) == ("-1/8", "0")
    assert below.holds is False and not below.established


def test_theorem_d5_instance_records_its_numbers():
    """Σ = diag(1/2, 2), C = (1/2, 0), S_1 = (0, 1), D_t = I/4, three steps, in fractions (no sympy)."""
    sigma, c = (Fraction(1, 2), Fraction(2)), (Fraction(1, 2), Fraction(0))
    s_star = tuple(ci / si for ci, si in zip(c, sigma))  # (1, 0)
    excess = lambda s: sum(si * (x - y) ** 2 for si, x, y in zip(sigma, s, s_star)) / 2  # noqa: E731
    s, s1, regret = (Fraction(0), Fraction(1)), (Fraction(0), Fraction(1)), Fraction(0)
    for _ in range(3):
        g = tuple(si * x - ci for si, x, ci in zip(sigma, s, c))
        g2 = sum(x * x for x in g)
        after = tuple(x - gi / 4 for x, gi in zip(s, g))
        regret += excess(after) / g2  # h(D) − h(D⋆) = (f(S − gD) − f*)/‖g‖²
        s = after
    z = theorem_d5.bound_instance()
    assert (z["lhs"], z["regret"], z["L"]) == (excess(s), regret, 2)
    assert z["rhs"] == excess(s1) * (2 * 2 * regret / 3) ** 3
    assert z["lhs"] <= z["rhs"]


# --- no step is a constant -------------------------------------------------------------------------


def _constant_steps(path: Path) -> list[str]:
    """Dict entries and subscript assignments with a literal True/False value, and symbols declared both
    nonnegative and nonpositive (a zero in disguise), in one proof module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        values = []
        if isinstance(node, ast.Dict):
            values = node.values
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Subscript) for t in node.targets):
            values = [node.value]
        found += [f"{path.name}:{v.lineno}" for v in values
                  if isinstance(v, ast.Constant) and isinstance(v.value, bool)]
        if isinstance(node, ast.Call):
            flags = {k.arg for k in node.keywords if isinstance(k.value, ast.Constant) and k.value.value is True}
            if {"nonnegative", "nonpositive"} <= flags:
                found.append(f"{path.name}:{node.lineno} (nonnegative and nonpositive)")
    return found


def test_no_step_is_a_constant(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('def s():\n    z = Symbol("z", nonnegative=True, nonpositive=True)\n'
                       '    steps = {"a": vanishes(x)}\n    steps["b"] = True\n    return {"c": True}\n')
    assert len(_constant_steps(planted)) == 3
    found = [hit for path in sorted(PROOFS.glob("*.py")) for hit in _constant_steps(path)]
    assert not found, found


# --- every step of every claim: a Check, and its negative control fails ----------------------------


def _derivations(evidence):
    for piece in evidence:
        if isinstance(piece, Derivation):
            yield piece
        elif isinstance(piece, Conditional):
            yield from _derivations(piece.under)


def _family(name: str) -> str:
    """A step's name without its grid point (``"K=2, V=1: H s = λ s"`` → ``"H s = λ s"``)."""
    return re.sub(r"^(\w+=\d+, )*\w+=\d+: ", "", name)


@pytest.mark.parametrize("index", range(len(ledger.CLAIMS)), ids=[c.id for c in ledger.CLAIMS])
def test_every_step_is_a_check_whose_perturbation_fails(ledger_results, index):
    """Each step of the claim is a Check that holds, and for every step (over its grid: a K = 1 instance
    may be 0 = 0 where K = 2 is not) the step's own perturbation is not established."""
    result = ledger_results[index]
    families: dict[tuple[str, str], list[Check]] = {}
    for proof in _derivations(result.outcome.evidence):
        for name, step in proof.steps.items():
            assert isinstance(step, Check) and step.ok, f"{proof.label}: {name}"
            families.setdefault((proof.label, _family(name)), []).append(step)
    cannot_fail = [key for key, steps in families.items() if not any(s.can_fail() for s in steps)]
    assert not cannot_fail, cannot_fail


def test_a_check_that_cannot_fail_is_recognised():
    x, y = sp.symbols("x y", real=True)
    zero = sp.Symbol("z", nonnegative=True, nonpositive=True)  # a zero in disguise
    assert vanishes((x + y) ** 2, x**2 + 2 * x * y + y**2).can_fail()
    assert not vanishes(x - x).can_fail()  # 0 = 0: nothing to perturb
    assert vanishes(x, x).can_fail()  # x = x has sides: x = 2x fails
    assert is_nonnegative(x**2).can_fail() and not is_nonnegative(zero).can_fail()
    assert is_nonnegative(zero).ok  # the disguise passes the step itself, not its control
    assert holds_on(x**2 - 1, 0, {x: 1}).can_fail()  # (x² − 2 at x = 1 is not 0)
    assert is_nonzero(sp.Matrix([[x, 1], [1, x]]).det()).can_fail()
    assert relation(sp.Rational(1, 3), "<", 1).can_fail() and relation(-sp.oo, "=", -sp.oo).can_fail()
    assert all_vanish(sp.Matrix([x * y]), sp.Matrix([y * x])).can_fail()


def test_a_step_replaced_by_a_constant_fails_its_claim(monkeypatch):
    steps = theorem_d5.rayleigh_steps()
    name = next(iter(steps))
    monkeypatch.setattr(theorem_d5, "rayleigh_steps", lambda rayleigh=2: {**steps, name: True})
    outcome = theorem_d5.check_lemma_d3()
    assert outcome.status == "failed" and "(not a checked step)" in outcome.detail
