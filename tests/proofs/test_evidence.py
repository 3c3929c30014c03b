"""Evidence and the status derived from it: only definite, exact results count, and a counterexample
can never end up verified."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import sympy as sp

from osdn_diag.proofs._claims import Outcome, conclude, status_of
from osdn_diag.proofs._evidence import (
    Conditional,
    Counterexample,
    Derivation,
    Witness,
    derive,
    exact_truth,
    format_sizes,
)
from osdn_diag.proofs._sym import Check, all_vanish, built, is_positive, relation, vanishes, vector

X = sp.Symbol("x", real=True)  # no sign assumption: ``x > 0`` is undecided
#: a step that holds, as the proofs' helpers make it (a bare True is not a checked step)
OK = vanishes((X + 1) ** 2, X**2 + 2 * X + 1)


def _piece(kind: str, ok: bool):
    """One piece of evidence of ``kind``, established or not."""
    if kind == "derivation":
        return Derivation("d", {"step": OK if ok else None})
    if kind == "witness":
        return Witness("w", 2, ">", 1 if ok else 3)
    if kind == "counterexample":
        return Counterexample("c", 2, "<=", 1 if ok else 3)
    return Conditional(
        "h",
        [Derivation("under", {"step": OK})],
        [Counterexample("without", 2, "<=", 1 if ok else 3)],
    )


def _expected(pieces: list[tuple[str, bool]]) -> str:
    """The rule, written out independently of :func:`status_of`."""
    if not pieces or not all(ok for _, ok in pieces):
        return "failed"
    kinds = {kind for kind, _ in pieces}
    if "counterexample" in kinds:
        return "refuted"
    if "conditional" in kinds:
        return "conditional"
    return "verified"


KINDS = ("derivation", "witness", "counterexample", "conditional")
COMBOS = [
    list(zip(kinds, oks))
    for n in range(0, 3)
    for kinds in itertools.combinations_with_replacement(KINDS, n)
    for oks in itertools.product((True, False), repeat=n)
]


def _combo_id(pieces) -> str:
    return "+".join(f"{kind}{'' if ok else '?'}" for kind, ok in pieces) or "none"


@pytest.mark.parametrize("pieces", COMBOS, ids=_combo_id)
def test_status_follows_the_evidence(pieces):
    outcome = Outcome("d", [_piece(kind, ok) for kind, ok in pieces])
    assert outcome.status == _expected(pieces)
    assert (outcome.condition is not None) == (outcome.status == "conditional")


def test_a_counterexample_is_never_verified():
    counter = Counterexample("claimed ratio ≤ 1/2000", sp.Rational(1, 128), "<=", sp.Rational(1, 2000))
    assert counter.established
    support = [Derivation("d", {"s": OK}), Witness("w", 1, "=", 1)]
    for extra in itertools.chain.from_iterable(itertools.combinations(support, n) for n in range(3)):
        assert Outcome("d", [*extra, counter]).status == "refuted"
        assert Outcome("d", [counter, *extra]).status == "refuted"
    # Passing the same numbers off as a witness establishes nothing: the relation is computed, not typed
    fields = {f.name: getattr(counter, f.name) for f in dataclasses.fields(counter)}
    assert not Witness(**fields).established
    assert Outcome("d", [Witness(**fields)]).status == "failed"


def test_a_status_cannot_be_typed_in():
    outcome = Outcome("d", [Derivation("p", {"s": OK})])
    with pytest.raises(dataclasses.FrozenInstanceError):
        outcome.status = "refuted"  # type: ignore[misc]
    with pytest.raises(TypeError):
        Outcome("d", [Derivation("p", {"s": OK})], status="refuted")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="cannot be given"):
        Outcome("verified", "because")


@pytest.mark.parametrize(
    "unknown", [None, X > 0, 1, "yes", sp.Symbol("b")], ids=["None", "relation", "one", "str", "symbol"]
)
def test_only_a_definite_truth_establishes_a_step(unknown):
    proof = Derivation("p", {"known": OK, "unknown": unknown})
    assert not proof.established and proof.unproved == ["unknown"]
    outcome = conclude("claimed", [proof])
    assert outcome.status == "failed" and "p: unknown" in outcome.detail


def test_only_a_check_that_holds_establishes_a_derivation_step():
    """A derivation step is a Check made by the sympy helpers: True, sympy's true or a comparison typed in
    as the step's value is not a checked step (it could not fail), and a Check that does not hold is not
    established either."""
    assert Derivation("p", {"a": OK, "b": is_positive(X**2 + 1)}).established
    for constant in (True, sp.true, sp.Rational(1, 3) < 1, 1):
        proof = Derivation("p", {"a": OK, "constant": constant})
        assert not proof.established and proof.unproved == ["constant"]
        assert "(not a checked step)" in conclude("d", [proof]).detail
    assert not Derivation("p", {"a": is_positive(X)}).established  # x > 0 undecided: ok is False
    assert isinstance(OK, Check) and OK.ok


def test_a_derivation_with_no_steps_establishes_nothing():
    assert not Derivation("p", {}).established
    assert conclude("d", []).status == "failed"
    with pytest.raises(ValueError, match="positive ints"):  # an empty grid covers nothing
        derive("p", lambda K: {"s": OK}, K=())


@pytest.mark.parametrize(
    "lhs, op, rhs, truth",
    [
        (sp.Rational(1, 128), "<=", sp.Rational(1, 2000), False),
        (sp.Rational(25, 16), ">", 1, True),
        (0, "!=", sp.Rational(1, 2), True),
        (sp.Integer(1), "=", 1, True),
        (X, ">", 0, None),  # undecided
        (sp.Float(0.5), "<", 1, None),  # not exact
        (sp.nan, "<", 1, None),
        (sp.nan, "=", sp.nan, None),
        (sp.I, "<", 1, None),  # no order on complex numbers
    ],
)
def test_exact_truth(lhs, op, rhs, truth):
    assert exact_truth(lhs, op, rhs) is truth


@pytest.mark.parametrize("cls", [Counterexample, Witness])
def test_an_undecided_or_inexact_instance_establishes_nothing(cls):
    for lhs in (X, sp.Float(2.0), sp.nan):
        assert not cls("case", lhs, ">", 1).established
    assert not cls("case", 2, ">", 1, steps={"supporting fact": None}).established


def test_instances_need_exact_numbers():
    with pytest.raises(TypeError, match="float"):
        Counterexample("case", 1, "<=", 0, instance={"beta": 0.5})
    with pytest.raises(ValueError, match="relation"):
        Counterexample("case", 1, "≤", 0)
    assert Counterexample("case", 1, "<=", 0, instance={"beta": sp.Rational(1, 2), "k": (1, 1)}).instance == {
        "beta": "1/2",
        "k": "(1, 1)",
    }


def test_derive_records_the_grid_it_ran():
    calls = []

    def steps(K, V):
        calls.append((K, V))
        k, v = vector("k", K), vector("v", V)
        return {"s": all_vanish((v * k.T) * k, v * (k.T * k)[0])}

    proof = derive("p", steps, K=range(1, 4), V=(2,))
    assert calls == [(1, 2), (2, 2), (3, 2)]
    assert proof.sizes == {"K": (1, 2, 3), "V": (2,)}
    assert list(proof.steps) == ["K=1, V=2: s", "K=2, V=2: s", "K=3, V=2: s"]
    assert derive("q", lambda: {"s": OK}).sizes == {}
    with pytest.raises(ValueError, match="positive ints"):
        derive("p", steps, K=(0, 1), V=(1,))


def test_derive_records_the_sizes_the_steps_built():
    """A proof asked for K = 1..4 that builds its vectors at K = 1 whatever it is given records K = 1 only:
    the sizes come from what the vectors, matrices and indexed families were built with."""

    def weakened(K, V):
        k, v = vector("k", 1), vector("v", V)  # ignores K
        return {"s": all_vanish((v * k.T) * k, v * (k.T * k)[0])}

    proof = derive("p", weakened, K=range(1, 5), V=(1, 2))
    # K = 2 is built at (K, V) = (2, 2) only through V, not at (2, 1): not recorded
    assert proof.established and proof.sizes == {"K": (1,), "V": (1, 2)}
    proof = derive("p", weakened, K=range(1, 5), V=(1,))
    assert proof.sizes == {"K": (1,), "V": (1,)}
    # a size no object is built with is not recorded at all; built() records a matrix assembled by hand
    assert derive("p", lambda K: {"s": OK}, K=(2, 3)).sizes == {}
    assert derive("p", lambda K: {"s": OK, "m": relation(built(sp.ones(K, 1)).rows, "=", K)}, K=(2, 3)).sizes == {
        "K": (2, 3)
    }


def test_a_conditional_needs_both_sides():
    under, without = Derivation("u", {"s": OK}), Counterexample("w", 1, "<=", 0)
    assert Conditional("h", [under], [without]).established
    assert not Conditional("h", [under], []).established
    assert not Conditional("h", [], [without]).established
    assert not Conditional("h", [under], [Counterexample("w", 0, "<=", 1)]).established  # not a counterexample
    with pytest.raises(TypeError):
        Conditional("h", [without], [without])


@pytest.mark.parametrize(
    "sizes, text",
    [
        ({"K": range(1, 5), "V": (1, 2)}, "K = 1..4, V ∈ {1, 2}"),
        ({"C": (2, 3, 4), "K": 2}, "C = 2..4, K = 2"),
        ({"C": (2, 4, 5)}, "C ∈ {2, 4, 5}"),
        ({}, ""),
    ],
)
def test_format_sizes(sizes, text):
    assert format_sizes(sizes) == text


def test_status_of_an_empty_or_unfinished_list_is_failed():
    assert status_of([]) == ("failed", None)
    assert status_of([Derivation("p", {"s": True}), Derivation("q", {"s": None})]) == ("failed", None)
