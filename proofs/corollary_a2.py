"""Corollary A.2 (App. A.4): monotone descent of the token loss inside the box [d_min, d_max]^K.

Notation: ``s = k ⊙ k`` with unit keys (``s_i ≥ 0``, ``Σ s_i = 1``), gate ``β ∈ (0, 1)``,
``d ∈ [d_min, d_max]^K`` with ``0 < d_min ≤ d_max ≤ 2``, write gain ``a = β⟨d, s⟩``; by Lemma 4.1 the
token loss ratio is ``(1 − a)²``.

Proof, for K = 1..4 with explicit symbols. Every hypothesis becomes a sign assumption on a free
symbol: ``d_i = d_min + w t_i`` with ``w = d_max − d_min ≥ 0`` and ``t_i ≥ 0``, ``τ_i = 1 − t_i ≥ 0``,
``m = 2 − d_max ≥ 0``, ``g = 1 − β > 0``, ``s_i ≥ 0`` with ``s_K = 1 − Σ_{i<K} s_i``. On that set

    a     = β d_min + β w Σ t_i s_i                        (> 0: every term has a positive factor set)
    2 − a = 2g + β m + β w Σ τ_i s_i                       (> 0)
    1 − (1 − a)² = a (2 − a)                               (> 0 as a product of the two)

each identity checked by expanding after the substitutions, each sign derived by sympy from the
symbols' assumptions. For general K the same lines hold verbatim: ``⟨d, s⟩`` is a convex
combination of the ``d_i`` because ``s`` lies on the probability simplex.

The hypotheses are needed: :data:`COUNTER_CASES` records writes with ``d_max > 2`` and with
``β > 1`` (fla's ``allow_neg_eigval`` lets ``β ∈ (0, 2)``) whose loss ratio exceeds 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from ._claims import Claim, Outcome, conclude
from ._evidence import Witness, derive, format_sizes, format_values
from ._sym import holds_on, indexed, is_positive, vanishes

__all__ = ["CLAIMS", "COUNTER_CASES", "GRID", "CounterCase", "descent_steps", "loss_ratio", "write_gain"]

#: the key dimensions checked with explicit symbols
GRID = {"K": tuple(range(1, 5))}


def write_gain(beta, d, s) -> sp.Expr:
    """``a = β⟨d, s⟩`` for sequences ``d, s`` (exact when given Rationals)."""
    return sp.nsimplify(beta) * sum(sp.nsimplify(x) * sp.nsimplify(y) for x, y in zip(d, s))


def loss_ratio(beta, d, s) -> sp.Expr:
    """Lemma 4.1's token loss ratio ``(1 − a)²``."""
    return (1 - write_gain(beta, d, s)) ** 2


@dataclass(frozen=True)
class CounterCase:
    """A unit-key write (``s`` sums to 1) violating one hypothesis of Corollary A.2."""

    label: str
    beta: sp.Rational
    d: tuple
    s: tuple

    @property
    def gain(self) -> sp.Expr:
        return write_gain(self.beta, self.d, self.s)

    @property
    def ratio(self) -> sp.Expr:
        return loss_ratio(self.beta, self.d, self.s)


COUNTER_CASES = (
    CounterCase("d_max > 2", sp.Rational(9, 10), (sp.Rational(5, 2),), (sp.Integer(1),)),
    CounterCase("beta > 1 (allow_neg_eigval)", sp.Rational(19, 10), (sp.Rational(3, 2),), (sp.Integer(1),)),
)


def descent_steps(K: int) -> dict[str, bool]:
    """The proof steps above for one K; each value says whether the step was established."""
    beta, gap = sp.Symbol("beta", positive=True), sp.Symbol("g", positive=True)
    d_min = sp.Symbol("d_min", positive=True)
    w, m = sp.Symbol("w", nonnegative=True), sp.Symbol("m", nonnegative=True)
    t = indexed("t", K, nonnegative=True)
    tau = indexed("tau", K, nonnegative=True)
    s = indexed("s", K, nonnegative=True)
    constraints = {
        gap: 1 - beta,
        m: 2 - d_min - w,
        s[-1]: 1 - sum(s[:-1]),
        **{tau_i: 1 - t_i for tau_i, t_i in zip(tau, t)},
    }
    a = beta * sum((d_min + w * t_i) * s_i for t_i, s_i in zip(t, s))
    lower = beta * d_min + beta * w * sum(t_i * s_i for t_i, s_i in zip(t, s))
    upper = 2 * gap + beta * m + beta * w * sum(tau_i * s_i for tau_i, s_i in zip(tau, s))
    return {
        "a = β d_min + β w Σ t_i s_i on the constraint set": holds_on(a, lower, constraints),
        "2 − a = 2(1 − β) + β(2 − d_max) + β w Σ (1 − t_i) s_i": holds_on(2 - a, upper, constraints),
        "1 − (1 − a)² = a(2 − a)": vanishes(1 - (1 - a) ** 2, a * (2 - a)),
        "a > 0": is_positive(lower),
        "2 − a > 0": is_positive(upper),
        "1 − (1 − a)² > 0": is_positive(lower * upper),
    }


def check_descent() -> Outcome:
    proof = derive("hypotheses as sign assumptions", descent_steps, **GRID)
    sizes = format_sizes(proof.sizes)
    return conclude(
        "With unit keys, β ∈ (0,1) and d ∈ [d_min, d_max]^K, 0 < d_min ≤ d_max ≤ 2: a = β⟨d,s⟩ "
        "∈ [β d_min, β d_max] ⊂ (0, 2) and 1 − (1 − a)² = a(2 − a) > 0, so the loss ratio (1 − a)² < 1; "
        f"proved for {sizes}, and for every K by the same convex-combination lines.",
        [proof],
        numbers={"K_checked": format_values(proof.sizes["K"])},
    )


def counter_witness(case: CounterCase) -> Witness:
    """The write of ``case`` raises the token loss: ratio (1 − βd)² > 1, exactly."""
    return Witness(
        case.label,
        case.ratio,
        ">",
        1,
        instance={"beta": case.beta, "d": case.d, "s": case.s, "a": case.gain},
        sizes={"K": len(case.d)},
        steps={"s sums to 1 (unit key)": sum(case.s) == 1},
    )


def check_counter_cases() -> Outcome:
    witnesses = [counter_witness(c) for c in COUNTER_CASES]
    parts = [
        f"{c.label}: β = {c.beta}, d = {c.d[0]}, {format_sizes(w.sizes)} → a = {c.gain}, ratio {c.ratio} = "
        f"{float(c.ratio):g}"
        for c, w in zip(COUNTER_CASES, witnesses)
    ]
    return conclude(
        "Dropping either hypothesis breaks descent: " + "; ".join(parts) + ".",
        witnesses,
        numbers={f"ratio[{c.label}]": float(c.ratio) for c in COUNTER_CASES},
    )


CLAIMS = [
    Claim(
        id="corollary-a2-monotone-descent",
        location="App. A.4, Cor. A.2; Sec. 4.2",
        quote="Corollary A.2 (Monotone descent under bounded box).",
        statement="Unit keys, β ∈ (0,1) and d ∈ [d_min, d_max]^K with 0 < d_min ≤ d_max ≤ 2 give "
        "0 < β⟨d, s⟩ < 2, hence a token loss ratio (1 − β⟨d, s⟩)² < 1.",
        method=f"sympy, {format_sizes(GRID)}: hypotheses as sign assumptions on free symbols; a, 2 − a and "
        "1 − (1 − a)² rewritten (identities checked after eliminating Σs = 1) as sums/products of "
        "positive terms; general K: ⟨d, s⟩ is a convex combination of the d_i.",
        expected="verified",
        check=check_descent,
    ),
    Claim(
        id="corollary-a2-hypotheses-needed",
        location="App. A.4, Cor. A.2 (hypotheses d_max ≤ 2, β < 1)",
        quote="with 0 < d min ≤ d max ≤ 2 . Then 0 < β t ⟨ d t , k t 2 ⟩ < 2",
        statement="Without d_max ≤ 2, or with gates β > 1 as fla's allow_neg_eigval permits, one "
        "write can increase the token loss.",
        method="exact rational arithmetic on two unit-key writes "
        f"({format_sizes({'K': sorted({len(c.d) for c in COUNTER_CASES})})}): ratio (1 − βd)² > 1.",
        expected="verified",
        check=check_counter_cases,
    ),
]
