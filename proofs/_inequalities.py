"""Classical inequalities proved for every length by induction, with the index a sympy symbol.

An induction step is accepted the way every other step of :mod:`proofs` is: the claimed difference is
rewritten, by an identity that expands to 0 (with the index ``n`` a positive-integer symbol), as an
expression whose sign sympy derives from the declared assumptions — the inductive hypothesis enters
as a nonnegative symbol standing for the difference it asserts to be ``≥ 0``.

* Bernoulli: ``(1 + y)^n ≥ 1 + n y`` for ``y ≥ −1`` and every integer ``n ≥ 1``.
* Powers are monotone: ``0 ≤ a ≤ b ⇒ a^n ≤ b^n``.
* AM–GM: ``Π_{i≤n} x_i ≤ (mean x)^n`` for ``x_i ≥ 0``. Step ``n → n + 1``: with ``a`` the mean of the
  first ``n`` and ``b = (n a + x)/(n + 1)``, Bernoulli at ``y = b/a − 1`` gives ``b^{n+1} ≥ a^n x``
  (``a > 0``; for ``a = 0`` the product is 0), and ``Π_{i≤n+1} x_i = x Π_{i≤n} x_i ≤ x a^n``.
"""

from __future__ import annotations

import sympy as sp

from ._sym import holds_on, is_nonnegative, vanishes

__all__ = ["am_gm_steps", "bernoulli_steps", "power_monotone_steps"]

_n = sp.Symbol("n", positive=True, integer=True)


def bernoulli_steps() -> dict[str, bool]:
    """``(1 + y)^n ≥ 1 + n y`` (``y ≥ −1``): base case and the step ``n → n + 1``."""
    y = sp.Symbol("y", real=True)
    z = sp.Symbol("z", nonnegative=True)  # 1 + y ≥ 0
    hyp = sp.Symbol("P", nonnegative=True)  # (1 + y)^n − (1 + n y) ≥ 0, the inductive hypothesis
    step = (1 + y) ** (_n + 1) - (1 + (_n + 1) * y)
    return {
        "Bernoulli n = 1: (1 + y)¹ − (1 + y) = 0": vanishes((1 + y) ** 1, 1 + 1 * y),
        "Bernoulli step: (1+y)^(n+1) − (1+(n+1)y) = (1+y)·[(1+y)^n − (1+ny)] + n y²": holds_on(
            step, z * hyp + _n * y**2, {z: 1 + y, hyp: (1 + y) ** _n - 1 - _n * y}
        ),
        "Bernoulli step: (1+y)·P + n y² ≥ 0": is_nonnegative(z * hyp + _n * y**2),
    }


def power_monotone_steps() -> dict[str, bool]:
    """``0 ≤ a ≤ b ⇒ a^n ≤ b^n``: the step ``b^{n+1} − a^{n+1} = b(b^n − a^n) + a^n(b − a)``."""
    a, gap = sp.Symbol("a", nonnegative=True), sp.Symbol("g", nonnegative=True)  # b = a + g
    hyp = sp.Symbol("P", nonnegative=True)  # b^n − a^n ≥ 0
    b = a + gap
    return {
        "powers n = 1: b − a = g ≥ 0": is_nonnegative(gap),
        "powers step: b^(n+1) − a^(n+1) = b·(b^n − a^n) + a^n·(b − a)": holds_on(
            b ** (_n + 1) - a ** (_n + 1), b * hyp + a**_n * gap, {hyp: b**_n - a**_n}
        ),
        "powers step: b·P + a^n·g ≥ 0": is_nonnegative((a + gap) * hyp + a**_n * gap),
    }


def am_gm_steps() -> dict[str, bool]:
    """AM–GM for every number of factors: Bernoulli, then the step ``n → n + 1`` described above."""
    a, b = sp.symbols("a b", positive=True)  # mean of the first n factors (a > 0), mean of all n + 1
    x = sp.Symbol("x", nonnegative=True)  # the new factor
    bern = sp.Symbol("Q", nonnegative=True)  # (b/a)^(n+1) − (1 + (n+1)(b/a − 1)) ≥ 0, Bernoulli
    x_of_b = (_n + 1) * b - _n * a  # b = (n a + x)/(n + 1)
    gap = b ** (_n + 1) - a**_n * x
    rewritten = a ** (_n + 1) * bern
    return {
        **bernoulli_steps(),
        "AM–GM n = 1: x − x = 0": vanishes(x**1, (1 * x / 1) ** 1),
        "AM–GM step: 1 + (n+1)(b/a − 1) = x/a for b = (na + x)/(n+1)": vanishes(
            (1 + (_n + 1) * (b / a - 1) - x / a).subs(x, x_of_b)
        ),
        "AM–GM step: b^(n+1) − a^n x = a^(n+1)·[(b/a)^(n+1) − 1 − (n+1)(b/a − 1)]": vanishes(
            gap, rewritten, after={bern: (b / a) ** (_n + 1) - 1 - (_n + 1) * (b / a - 1), x: x_of_b}
        ),
        "AM–GM step: a^(n+1)·Q ≥ 0": is_nonnegative(rewritten),
        "AM–GM step, a = 0: the product of the first n is 0 and b^(n+1) ≥ 0": is_nonnegative(
            ((x / (_n + 1)) ** (_n + 1))
        ),
    }
