"""Small sympy helpers shared by the proof modules.

Two kinds of evidence are accepted:

* an **identity** holds when the numerator of ``lhs − rhs`` (over a common denominator) is the zero
  polynomial (:func:`vanishes`). A numerator built from commuting finite symbols, rational numbers,
  sums, products and non-negative integer powers is evaluated in the sparse polynomial ring
  ``Q[symbols]``, where zero is decided exactly (the same answer as expanding it, often a hundred
  times faster: the GatedDeltaProduct token product at n = K = V = 2 took 21.6 s to expand, 0.24 s
  in the ring). Anything else (the free algebra's noncommuting symbols, a symbol declared infinite,
  a tree too deep for the ring's recursion) is expanded by sympy, and ``simplify`` is tried only
  when the result is not a rational function of its symbols (e.g. powers like ``(−1)^t``);
* a **sign** holds when sympy derives it from the declared assumptions of the symbols
  (:func:`is_positive`, :func:`is_nonnegative`); a sympy "unknown" counts as not established.

Constraints between symbols (``Σ s_i = 1``, ``gap = 1 − β``, …) enter an identity as a substitution
that eliminates the dependent symbols (:func:`holds_on`): the identity is then proved on the
constraint set, and a sign form written in the free symbols applies there because each of its
symbols satisfies its assumption on that set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import sympy as sp
from sympy.polys.rings import ring

__all__ = [
    "all_vanish",
    "dot",
    "holds_on",
    "is_nonnegative",
    "is_positive",
    "matrix",
    "vanishes",
    "vector",
]


def vector(name: str, n: int, **assumptions) -> sp.Matrix:
    """Column vector ``(name_1, …, name_n)ᵀ`` of fresh symbols with the given assumptions."""
    return sp.Matrix([sp.Symbol(f"{name}_{i + 1}", **assumptions) for i in range(n)])


def matrix(name: str, rows: int, cols: int, **assumptions) -> sp.Matrix:
    """``rows × cols`` matrix of fresh symbols ``name_{ij}`` (1-based)."""
    return sp.Matrix(rows, cols, lambda i, j: sp.Symbol(f"{name}_{i + 1}{j + 1}", **assumptions))


def dot(a: sp.Matrix, b: sp.Matrix) -> sp.Expr:
    """Euclidean inner product of two column vectors."""
    return sum((x * y for x, y in zip(a, b)), sp.Integer(0))


class _NotPolynomial(Exception):
    """The expression has a noncommutative or infinite symbol, or a node that is not a symbol, a
    rational, a sum, a product or a power with a non-negative integer exponent."""


def _polynomial(expr: sp.Expr):
    """``expr`` as an element of the sparse ring ``Q[free symbols]``, evaluated node by node (shared
    subexpressions once), never expanded as a sympy expression. Raises :class:`_NotPolynomial`."""
    symbols = sorted(expr.free_symbols, key=sp.default_sort_key)
    # the ring commutes (x·y − y·x would read as 0), and knows no infinity (sympy reads 0·x as nan
    # for a symbol declared infinite)
    if not all(s.is_commutative and not s.is_infinite for s in symbols):
        raise _NotPolynomial(expr)
    R, *gens = ring(symbols or [sp.Dummy("one")], sp.QQ)
    value = dict(zip(symbols, gens))
    memo: dict = {}

    def ev(e):
        if e in memo:
            return memo[e]
        if e.is_Symbol:
            v = value[e]
        elif e.is_Rational:
            v = R(e)
        elif e.is_Add:
            v = _sum([ev(a) for a in e.args])
        elif e.is_Mul:
            parts = [ev(a) for a in e.args]
            v = parts[0]
            for p in parts[1:]:
                v = v * p
        elif e.is_Pow and e.exp.is_Integer and e.exp >= 0:
            v = ev(e.base) ** int(e.exp)
        else:
            raise _NotPolynomial(e)
        memo[e] = v
        return v

    return ev(expr)


def _sum(parts: list):
    """The sum of ring elements, added term by term into one copy: ``a + b + …`` would copy the running
    total at every term (a sum of n terms in O(n²))."""
    total = parts[0].copy()
    zero = total.ring.domain.zero
    for p in parts[1:]:
        for monomial, c in p.items():
            c = total.get(monomial, zero) + c
            if c:
                total[monomial] = c
            else:
                total.pop(monomial, None)
    return total


def vanishes(expr: sp.Expr) -> bool:
    """True iff ``expr`` is identically zero (see the module docstring for what is tried)."""
    # one fraction over a common denominator (no gcd cancellation needed: a rational function is 0
    # exactly when the numerator of any such representation is the zero polynomial)
    num, _ = sp.sympify(expr).as_numer_denom()
    try:
        return _polynomial(num) == 0
    except (_NotPolynomial, RecursionError):  # a tree deeper than the ring's recursion: expand it
        pass
    num = sp.expand(num)
    if num == 0:
        return True
    if num.is_polynomial() and num.is_rational_function():
        return False  # a nonzero expanded polynomial is not identically zero
    return sp.simplify(num) == 0


def all_vanish(exprs: Iterable[sp.Expr]) -> bool:
    """True iff every entry vanishes identically."""
    return all(vanishes(e) for e in exprs)


def holds_on(lhs: sp.Expr, rhs: sp.Expr, constraints: Mapping[sp.Symbol, sp.Expr]) -> bool:
    """True iff ``lhs = rhs`` identically after eliminating symbols by ``constraints``."""
    return vanishes((sp.sympify(lhs) - sp.sympify(rhs)).subs(dict(constraints), simultaneous=True))


def is_positive(expr: sp.Expr) -> bool:
    """True iff sympy derives ``expr > 0`` from the symbols' assumptions."""
    return sp.sympify(expr).is_positive is True


def is_nonnegative(expr: sp.Expr) -> bool:
    """True iff sympy derives ``expr ≥ 0`` from the symbols' assumptions."""
    return sp.sympify(expr).is_nonnegative is True
