"""Evidence: what a check computed, and what it therefore established.

A claim's status is never typed in by its proof; :class:`~._claims.Outcome` derives it from the
evidence built here (see :func:`~._claims.status_of`). Four kinds:

* :class:`Derivation` — named symbolic steps (identities that expand to 0, signs sympy derives from
  assumptions). Built by :func:`derive`, it runs its steps at every point of a grid of sizes and
  records that grid as ``sizes`` (e.g. ``{"K": (1, 2, 3, 4), "V": (1, 2)}``); an empty grid means the
  steps involve no size (scalars, or an argument free of dimensions). Establishes: the statement holds
  for those sizes.
* :class:`Counterexample` — a concrete instance on which a relation the claim asserts, ``lhs op rhs``,
  is evaluated exactly (sympy numbers, no floats) and is false. Establishes: the claim fails.
* :class:`Witness` — a concrete instance on which a relation the claim says can occur is evaluated
  exactly and is true (an existence statement, or a case showing a distinction the claim draws).
* :class:`Conditional` — derivations (or witnesses) that hold once a stated hypothesis is added, and
  counterexamples showing the conclusion fails without it.

Only a definite truth counts: a step or relation establishes something when it evaluates to Python
``True``/``False`` or sympy's ``true``/``false``; sympy's ``None`` or an unevaluated relation
("unknown"), a float or a NaN establishes nothing.

Sizes map a dimension's name (``K``, ``V``, ``T``, ``C``, ``t``, ``d_v``, …) to the tuple of the
positive integers covered; :func:`format_sizes` writes them for the ledger's prose, so a detail text
names exactly the sizes that were run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import sympy as sp

from ._sym import Check, sizes_built

__all__ = [
    "EVIDENCE_KINDS",
    "Conditional",
    "Counterexample",
    "Derivation",
    "Witness",
    "derive",
    "exact_truth",
    "format_sizes",
    "format_values",
    "is_definitely_true",
]

#: the relations an instance can be checked against, by the symbol used in records
RELATIONS: dict[str, Callable] = {
    "<": sp.StrictLessThan,
    "<=": sp.LessThan,
    "=": sp.Eq,
    "!=": sp.Ne,
    ">=": sp.GreaterThan,
    ">": sp.StrictGreaterThan,
}


def is_definitely_true(value: object) -> bool:
    """True only for Python ``True``, sympy's ``true`` and a :class:`~._sym.Check` that holds (not for
    ``None``, 1, a relation, …)."""
    return value is True or value is sp.true or (isinstance(value, Check) and value.ok)


def exact_truth(lhs, op: str, rhs) -> bool | None:
    """``lhs op rhs`` evaluated exactly: True, False, or None when it cannot be decided exactly.

    None when either side holds a float (not exact), a NaN or complex infinity, or when sympy
    leaves the relation unevaluated (e.g. free symbols without the assumptions that decide it).
    """
    if op not in RELATIONS:
        raise ValueError(f"relation must be one of {tuple(RELATIONS)}, got {op!r}")
    lhs, rhs = sp.sympify(lhs), sp.sympify(rhs)
    for side in (lhs, rhs):
        if side.atoms(sp.Float) or side.has(sp.nan, sp.zoo):
            return None
    try:
        result = RELATIONS[op](lhs, rhs)
    except TypeError:  # e.g. an ordering of non-real numbers
        return None
    if result is sp.true:
        return True
    if result is sp.false:
        return False
    return None


def _sizes(sizes: Mapping[str, Iterable[int] | int]) -> dict[str, tuple[int, ...]]:
    """Normalise ``{name: int or ints}`` to ``{name: tuple of ints}``; every size a positive int."""
    out: dict[str, tuple[int, ...]] = {}
    for name, values in dict(sizes).items():
        values = (values,) if isinstance(values, int) else tuple(values)
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise ValueError(f"sizes[{name!r}] must be positive ints, got {values!r}")
        out[str(name)] = values
    return out


def format_values(values: Iterable[int] | int) -> str:
    """One size's values as text: ``2``, ``1..4`` (a run of ≥ 3 consecutive values) or ``{2, 3}``."""
    values = (values,) if isinstance(values, int) else tuple(values)
    if len(values) == 1:
        return str(values[0])
    if len(values) >= 3 and values == tuple(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}"
    return "{" + ", ".join(map(str, values)) + "}"


def format_sizes(sizes: Mapping[str, Iterable[int] | int]) -> str:
    """Sizes as prose: ``K = 1..4, V = 1..2``, ``C ∈ {2, 3}, K = 2``."""
    parts = []
    for name, values in _sizes(sizes).items():
        text = format_values(values)
        parts.append(f"{name} {'∈' if text.startswith('{') else '='} {text}")
    return ", ".join(parts)


def _exact_text(value: object) -> str:
    """An instance's value as exact text: ``9/10``, ``(1, 1)``; strings are kept as they are."""
    if isinstance(value, str):
        return value
    if isinstance(value, (tuple, list, sp.MatrixBase)):
        return "(" + ", ".join(_exact_text(v) for v in value) + ")"
    if isinstance(value, float):
        raise TypeError(
            f"instance value {value!r} is a float; give it exactly (an int, Fraction or sympy Rational)"
        )
    if isinstance(value, Fraction):
        value = sp.Rational(value.numerator, value.denominator)
    return str(sp.sympify(value))


@dataclass(frozen=True)
class Derivation:
    """Symbolic steps and the sizes they covered.

    ``steps`` maps a short description of each step to what it evaluated to (only a definite truth
    counts, see :func:`is_definitely_true`); ``sizes`` as in the module docstring. Use :func:`derive`
    so that ``sizes`` is the grid the steps actually ran on.
    """

    label: str
    steps: Mapping[str, object]
    sizes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    kind = "derivation"

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", dict(self.steps))
        object.__setattr__(self, "sizes", _sizes(self.sizes))

    @property
    def unproved(self) -> list[str]:
        """The steps that are not a :class:`~._sym.Check` that holds: a step sympy did not decide, or a
        value that was never checked (a constant ``True``, a Python comparison)."""
        return [name for name, ok in self.steps.items() if not (isinstance(ok, Check) and ok.ok)]

    @property
    def established(self) -> bool:
        return bool(self.steps) and not self.unproved

    def shortfall(self) -> list[str]:
        """What is missing, in words (empty when established)."""
        if not self.steps:
            return [f"{self.label}: no steps"]
        return [
            f"{self.label}: {name}" + ("" if isinstance(self.steps[name], Check) else " (not a checked step)")
            for name in self.unproved
        ]

    def record(self) -> dict:
        return {
            "kind": self.kind,
            "label": self.label,
            "sizes": {name: list(values) for name, values in self.sizes.items()},
            "steps": len(self.steps),
            "unproved": self.unproved,
            "established": self.established,
        }


def derive(label: str, steps_of: Callable[..., Mapping[str, object]], **grid: Iterable[int]) -> Derivation:
    """Run ``steps_of(**point)`` at every point of ``grid`` and collect the steps in one Derivation.

    ``grid`` maps each size's name to the values to cover, e.g. ``derive("…", f, K=range(1, 5), V=(1, 2))``
    calls ``f(K=1, V=1)``, …, ``f(K=4, V=2)``; each step's name is prefixed with its point
    (``"K=2, V=1: …"``). The recorded sizes are those the steps *built*: a value ``K = 3`` is recorded
    only if at every point with ``K = 3`` some vector, matrix or indexed family of that size was made
    (:func:`~._sym.sizes_built`), so a proof that is asked for K = 3 but builds K = 1 records less.
    """
    asked = _sizes(grid)
    steps: dict[str, object] = {}
    seen_at: list[tuple[dict, set[int]]] = []
    for point in itertools.product(*asked.values()):
        where = dict(zip(asked, point))
        prefix = ", ".join(f"{name}={value}" for name, value in where.items())
        with sizes_built() as seen:
            produced = steps_of(**where)
        seen_at.append((where, seen))
        for name, ok in produced.items():
            steps[f"{prefix}: {name}" if prefix else name] = ok
    sizes = {}
    for name, values in asked.items():
        ran = tuple(v for v in values if all(v in seen for where, seen in seen_at if where[name] == v))
        if ran:
            sizes[name] = ran
    return Derivation(label, steps, sizes)


@dataclass(frozen=True)
class _Instance:
    """A concrete case: ``lhs op rhs`` evaluated exactly, with the numbers that define the case.

    ``instance``: the case's parameters (written as exact text); ``sizes``: its dimensions;
    ``steps``: supporting facts about the case, each of which must be a definite truth.
    """

    label: str
    lhs: object
    op: str
    rhs: object
    instance: Mapping[str, object] = field(default_factory=dict)
    sizes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    steps: Mapping[str, object] = field(default_factory=dict)

    kind = "instance"
    needs = None  # the truth value of the relation that establishes this kind (set by subclasses)

    def __post_init__(self) -> None:
        if self.op not in RELATIONS:
            raise ValueError(
                f"{type(self).__name__}.op: the relation must be one of {tuple(RELATIONS)}, got {self.op!r}"
            )
        object.__setattr__(self, "lhs", sp.sympify(self.lhs))
        object.__setattr__(self, "rhs", sp.sympify(self.rhs))
        object.__setattr__(self, "instance", {str(k): _exact_text(v) for k, v in dict(self.instance).items()})
        object.__setattr__(self, "sizes", _sizes(self.sizes))
        object.__setattr__(self, "steps", dict(self.steps))

    @property
    def holds(self) -> bool | None:
        """The relation's exact truth on this instance (None: undecided)."""
        return exact_truth(self.lhs, self.op, self.rhs)

    @property
    def established(self) -> bool:
        if self.needs is None:  # a bare instance claims nothing
            return False
        return self.holds is self.needs and all(is_definitely_true(ok) for ok in self.steps.values())

    def shortfall(self) -> list[str]:
        missing = [f"{self.label}: {name}" for name, ok in self.steps.items() if not is_definitely_true(ok)]
        holds = self.holds
        if holds is not self.needs:
            word = {True: "true", False: "false", None: "undecided"}[holds]
            missing.append(f"{self.label}: {self.lhs} {self.op} {self.rhs} is {word}, a {self.kind} needs it "
                           f"{'true' if self.needs else 'false'}")
        return missing

    def record(self) -> dict:
        return {
            "kind": self.kind,
            "label": self.label,
            "sizes": {name: list(values) for name, values in self.sizes.items()},
            "instance": dict(self.instance),
            "relation": f"{self.lhs} {self.op} {self.rhs}",
            "lhs": str(self.lhs),
            "op": self.op,
            "rhs": str(self.rhs),
            "holds": self.holds,
            "established": self.established,
        }


@dataclass(frozen=True)
class Counterexample(_Instance):
    """An instance on which the relation the claim asserts is false (checked exactly)."""

    kind = "counterexample"
    needs = False


@dataclass(frozen=True)
class Witness(_Instance):
    """An instance on which a relation the claim says can occur is true (checked exactly)."""

    kind = "witness"
    needs = True


@dataclass(frozen=True)
class Conditional:
    """The claim holds once ``condition`` is added (``under``) and fails without it (``without``)."""

    condition: str
    under: tuple
    without: tuple

    kind = "conditional"

    def __post_init__(self) -> None:
        if not isinstance(self.condition, str) or not self.condition.strip():
            raise ValueError("Conditional.condition must state the added hypothesis")
        object.__setattr__(self, "under", tuple(self.under))
        object.__setattr__(self, "without", tuple(self.without))
        for name, allowed in (("under", (Derivation, Witness)), ("without", (Counterexample,))):
            for item in getattr(self, name):
                if not isinstance(item, allowed):
                    raise TypeError(f"Conditional.{name} takes {' or '.join(a.__name__ for a in allowed)}, "
                                    f"got {type(item).__name__}")

    @property
    def established(self) -> bool:
        parts = self.under + self.without
        return bool(self.under) and bool(self.without) and all(p.established for p in parts)

    def shortfall(self) -> list[str]:
        missing = [m for p in self.under + self.without for m in p.shortfall()]
        if not self.under:
            missing.append(f"under '{self.condition}': nothing derived")
        if not self.without:
            missing.append(f"without '{self.condition}': no counterexample")
        return missing

    def record(self) -> dict:
        return {
            "kind": self.kind,
            "condition": self.condition,
            "under": [p.record() for p in self.under],
            "without": [p.record() for p in self.without],
            "established": self.established,
        }


#: every kind of evidence an Outcome accepts
EVIDENCE_KINDS = (Derivation, Counterexample, Witness, Conditional)
