"""The record types of the claims ledger: a :class:`Claim` and the :class:`Outcome` of checking it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["ESTABLISHED", "STATUSES", "Claim", "Outcome", "conclude"]

#: Every status an outcome can have; ``failed`` means the check could not establish anything.
STATUSES = ("verified", "refuted", "conditional", "failed")
#: The statuses a claim can be expected to have (``failed`` is never an expectation).
ESTABLISHED = ("verified", "refuted", "conditional")


@dataclass(frozen=True)
class Outcome:
    """What a check established.

    ``status``: ``verified`` (the claim holds), ``refuted`` (it does not, with a counter-case),
    ``conditional`` (it holds under ``condition``) or ``failed`` (nothing established).
    ``detail``: what was shown, with the numbers. ``numbers``: key figures, JSON-serialisable.
    """

    status: str
    detail: str
    condition: str | None = None
    numbers: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Outcome.status must be one of {STATUSES}, got {self.status!r}")
        if self.status == "conditional" and not self.condition:
            raise ValueError("a 'conditional' outcome must state its condition")


@dataclass(frozen=True)
class Claim:
    """One statement of the paper (or of a reader), where it is, and how we check it.

    ``expected`` is the status we have established; the ledger flags any run whose outcome differs.
    """

    id: str
    location: str
    statement: str
    method: str
    expected: str
    check: Callable[[], Outcome]

    def __post_init__(self) -> None:
        if self.expected not in ESTABLISHED:
            raise ValueError(f"Claim.expected must be one of {ESTABLISHED}, got {self.expected!r}")


def conclude(
    status: str,
    detail: str,
    steps: Mapping[str, bool],
    *,
    condition: str | None = None,
    numbers: dict | None = None,
) -> Outcome:
    """Return ``Outcome(status, detail, ...)`` if every named proof step holds, else ``failed``.

    ``steps`` maps a short description of each step to whether it was established; only the value
    ``True`` itself counts (a sympy ``None`` — "unknown" — does not).
    """
    missing = [name for name, ok in steps.items() if ok is not True]
    if missing:
        return Outcome(
            "failed",
            "could not establish: " + "; ".join(missing),
            numbers=dict(numbers or {}),
        )
    return Outcome(status, detail, condition=condition, numbers=dict(numbers or {}))
