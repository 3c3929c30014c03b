"""The record types of the claims ledger: a :class:`Claim` and the :class:`Outcome` of checking it.

An outcome's status is derived from its evidence (:mod:`._evidence`) by :func:`status_of`; a proof
cannot state it. The rule, in order:

1. no evidence, or any piece not established → ``failed``;
2. any :class:`~._evidence.Counterexample` → ``refuted`` (a claim with a counterexample is never
   verified, whatever else was derived);
3. any :class:`~._evidence.Conditional` → ``conditional``, with its condition;
4. otherwise (derivations and witnesses only) → ``verified``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ._evidence import EVIDENCE_KINDS, Conditional, Counterexample

__all__ = ["ESTABLISHED", "SOURCES", "STATUSES", "Claim", "Outcome", "conclude", "status_of"]

#: Every status an outcome can have; ``failed`` means the check could not establish anything.
STATUSES = ("verified", "refuted", "conditional", "failed")
#: The statuses a claim can be expected to have (``failed`` is never an expectation).
ESTABLISHED = ("verified", "refuted", "conditional")
#: Whose statement a claim checks: the paper's (its text, theorems, tables, listings), or one the package
#: wrote itself (the paper's results asked of fla's further kernel families). Counts keep them apart, so
#: that a refuted statement of the package's own is never read as an error of the paper.
SOURCES = ("paper", "package")


def status_of(evidence: Iterable) -> tuple[str, str | None]:
    """``(status, condition)`` that ``evidence`` establishes, by the rule in the module docstring."""
    evidence = tuple(evidence)
    if not evidence or not all(e.established for e in evidence):
        return "failed", None
    if any(isinstance(e, Counterexample) for e in evidence):
        return "refuted", None
    conditions = [e.condition for e in evidence if isinstance(e, Conditional)]
    if conditions:
        return "conditional", "; ".join(conditions)
    return "verified", None


@dataclass(frozen=True)
class Outcome:
    """What a check established.

    ``detail``: what was shown, with the numbers. ``evidence``: the pieces of :mod:`._evidence` the
    check computed; ``status`` and ``condition`` are derived from them (:func:`status_of`).
    ``numbers``: key figures, JSON-serialisable. An outcome with no evidence (a check that raised)
    is ``failed``.
    """

    detail: str
    evidence: tuple = ()
    numbers: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.detail, str):
            raise TypeError(f"Outcome.detail must be a str, got {type(self.detail).__name__}")
        if isinstance(self.evidence, (str, bytes)) or not isinstance(self.evidence, Iterable):
            raise TypeError(
                "Outcome.evidence must be a sequence of Derivation/Counterexample/Witness/Conditional, "
                f"got {type(self.evidence).__name__}; the status is derived from it and cannot be given"
            )
        object.__setattr__(self, "evidence", tuple(self.evidence))
        for item in self.evidence:
            if not isinstance(item, EVIDENCE_KINDS):
                raise TypeError(f"Outcome.evidence holds a {type(item).__name__}, not evidence")

    @property
    def status(self) -> str:
        """``verified`` / ``refuted`` / ``conditional`` / ``failed``, derived from the evidence."""
        return status_of(self.evidence)[0]

    @property
    def condition(self) -> str | None:
        """The added hypothesis of a ``conditional`` outcome (None otherwise)."""
        return status_of(self.evidence)[1]


@dataclass(frozen=True)
class Claim:
    """One statement of the paper (or of a reader), where it is, and how we check it.

    ``expected`` is the status we have established; the ledger flags any run whose outcome differs.
    ``quote``: the paper's words at ``location``, verbatim from its text rendering (mathematical letters
    as that rendering spells them, e.g. ``k t`` for k_t); ``statement`` says what exactly is checked.
    ``source``: whose statement it is (:data:`SOURCES`).
    """

    id: str
    location: str
    statement: str
    method: str
    expected: str
    check: Callable[[], Outcome]
    quote: str = ""
    source: str = "paper"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"Claim.source must be one of {SOURCES}, got {self.source!r}")
        if self.expected not in ESTABLISHED:
            raise ValueError(f"Claim.expected must be one of {ESTABLISHED}, got {self.expected!r}")
        if self.quote != self.quote.strip():
            raise ValueError(f"Claim.quote of {self.id!r} has leading or trailing whitespace")


def conclude(detail: str, evidence: Iterable, *, numbers: dict | None = None) -> Outcome:
    """The :class:`Outcome` of ``evidence``; when something is not established its detail says what.

    Only a definite truth counts as established (a sympy ``None`` — "unknown" — does not); see
    :mod:`._evidence`.
    """
    evidence = tuple(evidence)
    missing = [m for e in evidence for m in e.shortfall()]
    if not evidence:
        missing = ["no evidence"]
    if missing:
        detail = "could not establish: " + "; ".join(missing)
    return Outcome(detail, evidence, numbers=dict(numbers or {}))
