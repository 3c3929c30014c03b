"""The proof modules: their helpers have teeth, and their exported numbers agree with plain numerics."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import sympy as sp
from hypothesis import given, settings
from hypothesis import strategies as st

from osdn_diag.proofs import arithmetic, corollary_a2, counterexample, theorem_d7, wy_chunk
from osdn_diag.proofs._claims import conclude
from osdn_diag.proofs._evidence import Derivation
from osdn_diag.proofs._sym import all_vanish, holds_on, is_positive, vanishes

RNG = np.random.default_rng(0)


def _write(S, v, k, d, beta):
    """One OSDN write S' = S + β u (d⊙k)ᵀ, in float64."""
    u = v - S @ k
    return S + beta * np.outer(u, d * k)


def _loss(S, k, v):
    r = S @ k - v
    return 0.5 * float(r @ r)


# --- helpers ----------------------------------------------------------------------------------------


def test_vanishes_accepts_identities_and_rejects_non_identities():
    x, y = sp.symbols("x y", real=True)
    assert vanishes((x + y) ** 2 - x**2 - 2 * x * y - y**2)
    assert vanishes(1 / (x + 1) + x / (x + 1) - 1)
    assert not vanishes((x + y) ** 2 - x**2 - y**2)
    assert not all_vanish([sp.Integer(0), x - y])
    assert holds_on(x + y, 1, {y: 1 - x})


def _random_polynomial(draw_int, symbols, depth):
    """A random unexpanded expression of sums, products and small powers (shared subtrees included)."""
    if depth == 0 or draw_int(0, 3) == 0:
        return symbols[draw_int(0, len(symbols) - 1)] if draw_int(0, 2) else sp.Rational(draw_int(-3, 3), draw_int(1, 3))
    a, b = (_random_polynomial(draw_int, symbols, depth - 1) for _ in range(2))
    op = draw_int(0, 2)
    return a + b if op == 0 else a * b if op == 1 else a ** draw_int(0, 3)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_vanishes_in_the_ring_agrees_with_expansion(seed):
    # the ring path must give expansion's answer on any polynomial, zero or not
    rng = np.random.default_rng(seed)
    symbols = sp.symbols("x y z", real=True)
    draw = lambda lo, hi: int(rng.integers(lo, hi + 1))  # noqa: E731
    e = _random_polynomial(draw, symbols, 4)
    f = _random_polynomial(draw, symbols, 3)
    assert bool(vanishes(e - f)) == (sp.expand(e - f) == 0)
    assert vanishes(e * f - sp.expand(e) * sp.expand(f))  # the same polynomial, written two ways
    assert bool(vanishes((e - f) / (1 + symbols[0] ** 2))) == (sp.expand(e - f) == 0)  # numerator decides


def test_vanishes_never_expands_a_polynomial(monkeypatch):
    # the GatedDeltaProduct token product at n = K = V = 2 took 21.6 s through sympy's expand
    x, y = sp.symbols("x y", real=True)

    def no_expand(*args, **kwargs):
        raise AssertionError("sympy's expand was called on a polynomial")

    monkeypatch.setattr(sp, "expand", no_expand)
    assert vanishes(((x + y) ** 3 - x**3) / x - (3 * x * y + 3 * y**2 + y**3 / x))
    assert not vanishes((x + y) ** 2 - x**2 - y**2)


def test_vanishes_falls_back_outside_polynomials():
    # nodes the ring cannot hold (a symbolic exponent, a float, an irrational) go through sympy
    x = sp.Symbol("x", real=True)
    n = sp.Symbol("n", integer=True)
    assert vanishes((-1) ** (2 * n) - 1)
    assert not vanishes((-1) ** n - 1)
    assert vanishes(sp.Float(0.5) * x - x / 2)
    assert vanishes(sp.sqrt(2) * x * sp.sqrt(2) - 2 * x)
    assert not vanishes(sp.sqrt(2) * x - x)
    assert vanishes(sp.Integer(0)) and not vanishes(sp.Integer(1))
    # noncommutative symbols (the free algebra of Lemma 4.1 and Lemma D.3): a commuting ring would
    # take A·B − B·A for zero
    A, B = sp.symbols("A B", commutative=False)
    assert not vanishes(A * B - B * A)
    assert not vanishes((A + B) ** 2 - A**2 - 2 * A * B - B**2)
    assert vanishes((A + B) ** 2 - A**2 - A * B - B * A - B**2)
    # a symbol declared infinite: sympy reads 0·x as nan there, which the ring cannot
    inf, y = sp.Symbol("inf", infinite=True), sp.Symbol("y")
    assert vanishes(inf * ((y + 1) ** 2 - y**2 - 2 * y - 1)).ok is False


def test_vanishes_on_a_tree_deeper_than_the_recursion_limit():
    # x(1 + x(1 + …)), 260 levels, with 450 frames of recursion left (as a tree twice as deep under
    # the default limit): the ring's recursion gives up, and expansion decides
    import inspect
    import sys

    from osdn_diag.proofs import _sym

    x = sp.Symbol("x")
    e = x
    for _ in range(130):
        e = x * (1 + e)
    zero = e - sp.Add(*[x**k for k in range(1, 132)])
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + 450)
    try:
        with pytest.raises(RecursionError):
            _sym._polynomial(zero.as_numer_denom()[0])
        assert vanishes(zero)
        assert not vanishes(e - sp.Add(*[x**k for k in range(1, 131)]))
    finally:
        sys.setrecursionlimit(limit)


def test_vanishes_adds_a_sum_term_by_term(monkeypatch):
    # a sum of n terms added as a + b + … copies the running total at each term, O(n²): the square of
    # a sum of 300 symbols against its expansion took 67 s that way, 11 s expanded
    from sympy.polys.rings import PolyElement

    x, y = sp.symbols("x y")
    wide = sp.Add(*[x**i * y ** (i % 7) for i in range(2000)])

    def no_add(self, other):
        raise AssertionError("a sum built with + on ring elements")

    monkeypatch.setattr(PolyElement, "__add__", no_add)
    monkeypatch.setattr(PolyElement, "__radd__", no_add)
    assert vanishes(wide - sp.Add(*reversed(wide.args), evaluate=False))
    assert not vanishes(wide - x**2000)


def test_sign_needs_strict_assumptions():
    b, w = sp.Symbol("b", positive=True), sp.Symbol("w", nonnegative=True)
    assert is_positive(b + w)
    assert not is_positive(b * w)  # only nonnegative: w may be 0
    assert not is_positive(sp.Symbol("r", real=True))


def test_conclude_reports_failed_unless_every_step_is_true():
    ok = vanishes(sp.Integer(2), 2)
    assert conclude("d", [Derivation("p", {"a": ok, "b": ok})]).status == "verified"
    out = conclude("d", [Derivation("p", {"a": ok, "b": None, "c": False})])
    assert out.status == "failed" and "p: b" in out.detail and "p: c" in out.detail


@pytest.mark.parametrize("unknown", [False, None], ids=["false", "sympy-unknown"])
def test_a_broken_step_fails_the_claim(monkeypatch, unknown):
    # None is what sympy's ``is_positive`` answers when the assumptions do not decide the sign
    monkeypatch.setattr(corollary_a2, "is_positive", lambda expr: unknown)
    outcome = corollary_a2.check_descent()
    assert outcome.status == "failed"
    assert "K=1: a > 0" in outcome.detail


def test_wy_check_detects_the_symmetric_gram():
    S, K, Kt, V, beta = wy_chunk._chunk_symbols(2, 2, 1)
    wrong = wy_chunk.chunk_state(S, K, Kt, V, beta, symmetric_gram=True)
    assert not all_vanish(wrong - wy_chunk.token_state(S, K, Kt, V, beta))


# --- Lemma 4.1 and Corollary A.2, numerically ---------------------------------------------------------


def test_lemma_4_1_closed_form_numerically():
    for _ in range(20):
        K, V = RNG.integers(1, 9, size=2)
        S, v, k = RNG.normal(size=(V, K)), RNG.normal(size=V), RNG.normal(size=K) * 3
        d, beta = RNG.uniform(-1, 3, size=K), RNG.uniform(0, 2)
        a, n = beta * float(d @ (k * k)), float(k @ k)
        S1 = _write(S, v, k, d, beta)
        ratio = _loss(S1, k, v) / _loss(S, k, v)
        h = (_loss(S1, k, v) - _loss(S, k, v)) / (2 * _loss(S, k, v) * n)
        assert ratio == pytest.approx((1 - a) ** 2, rel=1e-9, abs=1e-12)
        assert h == pytest.approx(((1 - a) ** 2 - 1) / (2 * n), rel=1e-9, abs=1e-12)


def test_descent_inside_the_box_numerically():
    for _ in range(200):
        K = int(RNG.integers(1, 17))
        k = RNG.normal(size=K)
        k /= np.linalg.norm(k)
        S, v = RNG.normal(size=(3, K)), RNG.normal(size=3)
        S1 = _write(S, v, k, RNG.uniform(0.5, 2.0, size=K), RNG.uniform(1e-3, 1 - 1e-3))
        assert _loss(S1, k, v) < _loss(S, k, v)


@pytest.mark.parametrize("case", corollary_a2.COUNTER_CASES, ids=lambda c: c.label)
def test_counter_cases_increase_the_loss(case):
    S, v = RNG.normal(size=(3, 1)), RNG.normal(size=3)
    k = np.array([1.0])
    d, beta = np.array([float(x) for x in case.d]), float(case.beta)
    S1 = _write(S, v, k, d, beta)
    ratio = _loss(S1, k, v) / _loss(S, k, v)
    assert ratio > 1
    assert ratio == pytest.approx(float(case.ratio), rel=1e-12)
    assert float(case.ratio) == pytest.approx((1 - beta * d[0]) ** 2)


def test_counter_case_values():
    by_label = {c.label: c for c in corollary_a2.COUNTER_CASES}
    assert by_label["d_max > 2"].gain == sp.Rational(9, 4)
    assert by_label["d_max > 2"].ratio == sp.Rational(25, 16)
    assert by_label["beta > 1 (allow_neg_eigval)"].ratio > 1


# --- Theorem D.7, numerically -------------------------------------------------------------------------


def test_realised_regret_identity_numerically():
    T, K = 50, 6
    k = RNG.normal(size=(T, K))
    s = (k / np.linalg.norm(k, axis=1, keepdims=True)) ** 2
    beta, traj = RNG.uniform(0, 1, size=T), RNG.uniform(0.5, 2, size=(T, K))
    q = (1 - beta * (traj * s).sum(1)) ** 2
    h = lambda x: ((1 - beta * (x * s).sum(-1)) ** 2 - 1) / 2  # noqa: E731
    for d in (RNG.uniform(0.5, 2, size=K), RNG.normal(size=K) * 10):  # inside and outside the box
        eps = 0.5 * np.mean((1 - beta * (s @ d)) ** 2)
        regret = float(np.sum(h(traj) - h(d)))
        assert 2 * eps + 2 * regret / T == pytest.approx(q.mean(), rel=1e-12)


def test_zero_residual_stream_violates_the_bound():
    for T in (1, 5, 20):
        z = theorem_d7.zero_residual_stream(T)
        assert z["prod_q"] == 1 and z["eps"] == 0
        assert z["bound_convention"] == 0 and z["bound_eq18"] == 0


def test_alternating_counterexample_replay():
    S, S_star = 0.0, 0.0
    for t in range(1, 21):
        before = (S - (-1) ** t) ** 2 / 2
        S = S + ((-1) ** t - S)  # β = d = k = 1
        assert (S - (-1) ** t) ** 2 / 2 == 0
        assert before == (0.5 if t == 1 else 2.0)
        assert abs(S - S_star) == 1
    assert [r[0] for r in counterexample.replay(4)] == [-1, 1, -1, 1]


# --- App. L arithmetic --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(24, 8, 128, 128), (24, 16, 128, 128), (12, 4, 64, 256), (1, 1, 7, 3)])
def test_state_overhead_is_one_over_dv(shape):
    L, H, dk, dv = shape
    ratio = arithmetic.overhead_ratio(L, H, dk, dv)
    assert ratio == sp.Rational(1, dv)
    assert Fraction(L * H * dk, L * H * dk * dv) == Fraction(1, dv)


def test_state_sizes_at_paper_shapes():
    assert arithmetic.mib_bf16(arithmetic.state_elements(24, 8, 128, 128)) == 6
    assert arithmetic.mib_bf16(arithmetic.d_elements(24, 8, 128)) == sp.Rational(3, 64)  # 0.046875
    assert arithmetic.mib_bf16(arithmetic.state_elements(24, 16, 128, 128)) == 12
    assert arithmetic.mib_bf16(arithmetic.d_elements(24, 16, 128)) == sp.Rational(3, 32)  # 0.09375
    assert float(100 * arithmetic.overhead_ratio(24, 8, 128, 128)) == 0.78125
