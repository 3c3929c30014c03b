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

import contextlib
from collections.abc import Iterable, Iterator, Mapping

import sympy as sp
from sympy.polys.rings import ring

__all__ = [
    "Check",
    "all_of",
    "all_vanish",
    "built",
    "dot",
    "free_of",
    "holds_on",
    "indexed",
    "is_nonnegative",
    "is_nonzero",
    "is_positive",
    "matrix",
    "relation",
    "sizes_built",
    "vanishes",
    "vector",
]


# --- the sizes of what was built ------------------------------------------------------------------

_built: list[set[int]] = []


def _note(*dims: int) -> None:
    """Record the dimensions of an object just built, in every open :func:`sizes_built` block."""
    for seen in _built:
        seen.update(int(d) for d in dims)


@contextlib.contextmanager
def sizes_built() -> Iterator[set[int]]:
    """Collect the dimensions of every vector, matrix and indexed family built inside the block.

    :func:`~._evidence.derive` runs each point of its grid inside one, so the sizes a derivation
    records are those its steps actually built, not those it was asked for.
    """
    seen: set[int] = set()
    _built.append(seen)
    try:
        yield seen
    finally:
        _built.remove(seen)


def indexed(name: str, n: int, **assumptions) -> tuple[sp.Symbol, ...]:
    """``(name_1, …, name_n)``: one symbol per index (a token, a chunk row, …), its size recorded."""
    _note(n)
    return tuple(sp.Symbol(f"{name}_{i + 1}", **assumptions) for i in range(n))


def built(m: sp.MatrixBase) -> sp.MatrixBase:
    """``m`` itself, its shape recorded (for a matrix assembled from rows rather than by :func:`matrix`)."""
    _note(*m.shape)
    return m


# --- checked steps ---------------------------------------------------------------------------------


class Check:
    """One proof step as sympy decided it, with what it decided on, so that it can be perturbed.

    ``kind``: ``identity`` (every expression of ``exprs`` is identically 0), ``positive`` /
    ``nonnegative`` (a sign derived from the symbols' assumptions), ``nonzero`` (not identically 0),
    ``relation`` (``exprs = (lhs, rhs)`` compared exactly by ``op``), ``free`` (``exprs[0]`` free of the
    symbols ``exprs[1:]``), ``all`` (``parts``, every one of them). ``ok`` is the verdict; a step is
    established only by a Check whose ``ok`` is True (:func:`._evidence.is_definitely_true`).

    :meth:`can_fail` is the step's negative control: it perturbs the step and reports whether the
    perturbed step fails, as a step that could never fail proves nothing. The perturbation, per kind:
    an identity gets one of its rational constants (a coefficient, an exponent, a ``−1`` of a
    difference) moved by 1, each in turn until one breaks it; a sign is negated (an expression both
    ``≥ 0`` and ``≤ 0`` is a zero in disguise); a nonzero polynomial is evaluated with its symbols at
    0 and at 1 (the checker must say "zero" at one of them); an exact relation gets its left side moved past the
    right; a freeness check gets one of the symbols added.
    """

    __slots__ = ("after", "exprs", "kind", "ok", "op", "parts", "sides", "subs")

    def __init__(self, kind: str, exprs=(), ok: bool = False, *, op: str = "", parts=(), after=None,
                 subs=None, sides=()) -> None:
        self.kind, self.exprs, self.ok, self.op, self.parts = kind, tuple(exprs), bool(ok), op, tuple(parts)
        self.after, self.subs, self.sides = dict(after or {}), dict(subs or {}), tuple(sides)

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"Check({self.kind}, ok={self.ok})"

    def can_fail(self) -> bool:
        """True iff the perturbed step (see the class docstring) is not established."""
        if self.kind == "all":
            return bool(self.parts) and all(p.can_fail() for p in self.parts)
        if self.kind == "identity":
            return _identity_can_fail(self.exprs, self.after, self.subs, self.sides)
        if self.kind in ("positive", "nonnegative"):
            return not all(sp.sympify(-e).is_nonnegative is True for e in self.exprs)
        if self.kind == "nonzero":
            return any(all(_vanishes(e.subs(dict.fromkeys(e.free_symbols, point))) for e in self.exprs)
                       for point in (0, 1))
        if self.kind == "relation":
            from ._evidence import exact_truth

            lhs, rhs = self.exprs
            if rhs.is_finite is False:  # ±∞ moved by 1 is itself
                past = {"!=": rhs}.get(self.op, sp.Integer(0))
            else:
                past = {"=": rhs + 1, "!=": rhs, "<": rhs + 1, "<=": rhs + 1, ">": rhs - 1, ">=": rhs - 1}[self.op]
            return exact_truth(past, self.op, rhs) is False
        if self.kind == "free":
            expr, *symbols = self.exprs
            return bool(symbols) and not _free(sp.Tuple(expr, symbols[0]), symbols)
        raise ValueError(f"unknown Check kind {self.kind!r}")


def _constants(expr: sp.Expr) -> list:
    """The distinct nonzero rational constants of ``expr``'s tree, in a fixed order."""
    return sorted({a for a in sp.sympify(expr).atoms(sp.Rational) if a != 0}, key=sp.default_sort_key)


def _identity_can_fail(exprs, after=None, subs=None, sides=()) -> bool:
    def fails(perturbed) -> bool:
        if subs:
            perturbed = [e.subs(subs, simultaneous=True) for e in perturbed]
        return not all(_vanishes(_rewritten(e, after)) for e in perturbed)

    constants = sorted({c for e in exprs for c in _constants(e)}, key=sp.default_sort_key)
    for c in constants:
        moved = c + 1 if c != -1 else sp.Integer(-2)  # −1 → 0 would merely drop a term's sign
        if fails([sp.sympify(e).xreplace({c: moved}) for e in exprs]):
            return True
    # a difference sympy reduced to 0 as it was built has no constant left: the statement lhs = rhs
    # becomes lhs = 2·rhs, which fails unless both sides are 0 (a step "0 = 0" proves nothing)
    return bool(sides) and fails([lhs - 2 * rhs for lhs, rhs in sides])


def _rewritten(expr, after):
    """``expr`` expanded and rewritten by ``after`` (noncommutative rules such as ``ΣPΣ → Σ``), or as is."""
    return sp.powsimp(sp.expand(sp.expand(expr).subs(after))) if after else expr


def all_of(checks: Iterable) -> Check:
    """One step made of several checks (e.g. one identity per token); every part must be a Check."""
    parts = tuple(checks)
    return Check("all", ok=bool(parts) and all(isinstance(p, Check) and p.ok for p in parts),
                 parts=[p if isinstance(p, Check) else Check("constant", ok=False) for p in parts])


def relation(lhs, op: str, rhs) -> Check:
    """``lhs op rhs`` for exact numbers (ints, Fractions, sympy Rationals), decided exactly."""
    from ._evidence import exact_truth

    lhs, rhs = sp.sympify(lhs), sp.sympify(rhs)
    return Check("relation", (lhs, rhs), exact_truth(lhs, op, rhs) is True, op=op)


def _free(expr, symbols) -> bool:
    return not (sp.sympify(expr).free_symbols & set(symbols))


def free_of(expr, symbols: Iterable[sp.Symbol]) -> Check:
    """``expr`` (an expression or a matrix) does not involve any of ``symbols`` (e.g. a comparator that
    cancels, a Hessian free of the state)."""
    symbols = tuple(symbols)
    expr = sp.Tuple(*expr) if isinstance(expr, sp.MatrixBase) else sp.sympify(expr)
    return Check("free", (expr, *symbols), _free(expr, symbols))


def is_nonzero(expr) -> Check:
    """``expr`` (a rational function of its symbols, or a matrix of them) is not identically 0."""
    exprs = tuple(expr) if isinstance(expr, sp.MatrixBase) else (sp.sympify(expr),)
    ok = all(e.is_rational_function() for e in exprs) and not all(_vanishes(e) for e in exprs)
    return Check("nonzero", exprs, ok)


def vector(name: str, n: int, **assumptions) -> sp.Matrix:
    """Column vector ``(name_1, …, name_n)ᵀ`` of fresh symbols with the given assumptions."""
    _note(n)
    return sp.Matrix([sp.Symbol(f"{name}_{i + 1}", **assumptions) for i in range(n)])


def matrix(name: str, rows: int, cols: int, **assumptions) -> sp.Matrix:
    """``rows × cols`` matrix of fresh symbols ``name_{ij}`` (1-based)."""
    _note(rows, cols)
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


def vanishes(lhs: sp.Expr, rhs: sp.Expr = 0, after: Mapping | None = None) -> Check:
    """The identity ``lhs = rhs`` (``lhs = 0`` by default): a :class:`Check` whose ``ok`` says whether
    ``lhs − rhs`` is identically zero. Give both sides where there are two: the negative control
    (:meth:`Check.can_fail`) needs them when sympy reduces the difference to 0 as it is built.

    ``after``: rewriting rules applied once the difference is expanded (in the free noncommutative
    algebra, e.g. ``{Σ P Σ: Σ}`` for a pseudoinverse); the Check keeps the difference before them, so
    that its negative control perturbs the statement rather than the already-reduced result.
    """
    lhs, rhs = sp.sympify(lhs), sp.sympify(rhs)
    expr = lhs - rhs
    return Check("identity", (expr,), _vanishes(_rewritten(expr, after)), after=after, sides=[(lhs, rhs)])


def _vanishes(expr: sp.Expr) -> bool:
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


def all_vanish(lhs: Iterable[sp.Expr], rhs: Iterable[sp.Expr] | None = None) -> Check:
    """The identities ``lhs_i = rhs_i`` (``lhs_i = 0`` by default) for every entry of two matrices or
    sequences of the same shape, as one :class:`Check`."""
    lhs = [sp.sympify(e) for e in lhs]
    rhs = [sp.Integer(0)] * len(lhs) if rhs is None else [sp.sympify(e) for e in rhs]
    if len(rhs) != len(lhs):
        raise ValueError(f"all_vanish: {len(lhs)} left sides, {len(rhs)} right sides")
    exprs = tuple(a - b for a, b in zip(lhs, rhs))
    return Check("identity", exprs, all(_vanishes(e) for e in exprs), sides=list(zip(lhs, rhs)))


def holds_on(lhs: sp.Expr, rhs: sp.Expr, constraints: Mapping[sp.Symbol, sp.Expr]) -> Check:
    """The identity ``lhs = rhs`` after eliminating symbols by ``constraints`` (the Check keeps the
    difference before the substitution, which its negative control perturbs)."""
    lhs, rhs, constraints = sp.sympify(lhs), sp.sympify(rhs), dict(constraints)
    diff = lhs - rhs
    return Check("identity", (diff,), _vanishes(diff.subs(constraints, simultaneous=True)), subs=constraints,
                 sides=[(lhs, rhs)])


def is_positive(expr: sp.Expr) -> Check:
    """``expr > 0`` as sympy derives it from the symbols' assumptions (``ok`` False when it cannot)."""
    expr = sp.sympify(expr)
    return Check("positive", (expr,), expr.is_positive is True)


def is_nonnegative(expr: sp.Expr) -> Check:
    """``expr ≥ 0`` as sympy derives it from the symbols' assumptions (``ok`` False when it cannot)."""
    expr = sp.sympify(expr)
    return Check("nonnegative", (expr,), expr.is_nonnegative is True)
