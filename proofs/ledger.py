"""The claims ledger: every claim of the proof modules, run, tabulated and written as JSON.

``osdn-diag prove`` calls :func:`run_ledger`, :func:`format_table` and :func:`write_json`, and exits
non-zero when a claim's outcome differs from the status recorded as ``Claim.expected``.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..runtime.atomic import atomic_path
from ..runtime.strict_json import dumps as strict_json
from . import (
    arithmetic,
    chunk_outputs,
    comparator_gap,
    corollary_a2,
    corollary_d8,
    counterexample,
    family_comba,
    family_gdn2,
    family_gated_deltaproduct,
    family_momentum_delta_rule,
    family_rwkv7,
    gated,
    inconsistencies,
    lemma_4_1,
    lemma_d6,
    newton_feasibility,
    paper_numbers,
    proximal,
    theorem_d5,
    theorem_d7,
    write_key,
    wy_chunk,
    zero_residual,
)
from ._claims import SOURCES, STATUSES, Claim, Outcome

__all__ = [
    "CLAIMS",
    "Claim",
    "ClaimResult",
    "Outcome",
    "format_table",
    "run_ledger",
    "to_records",
    "write_json",
]

MODULES = (
    lemma_4_1,
    write_key,
    corollary_a2,
    lemma_d6,
    proximal,
    theorem_d5,
    comparator_gap,
    theorem_d7,
    zero_residual,
    newton_feasibility,
    counterexample,
    corollary_d8,
    wy_chunk,
    chunk_outputs,
    gated,
    inconsistencies,
    arithmetic,
    paper_numbers,
    family_comba,
    family_gdn2,
    family_gated_deltaproduct,
    family_momentum_delta_rule,
    family_rwkv7,
)

#: Every claim, in ledger order. :func:`run_ledger` reads this at call time.
CLAIMS: list[Claim] = [claim for module in MODULES for claim in module.CLAIMS]


@dataclass
class ClaimResult:
    claim: Claim
    outcome: Outcome
    seconds: float

    @property
    def as_expected(self) -> bool:
        return self.outcome.status == self.claim.expected


def evaluate(claim: Claim) -> ClaimResult:
    """Run one check; an exception, or a result that is not an Outcome, becomes ``failed``."""
    start = time.perf_counter()
    try:
        outcome = claim.check()
        if not isinstance(outcome, Outcome):
            raise TypeError(f"check returned {type(outcome).__name__}, not Outcome")
    except Exception as exc:  # noqa: BLE001 - any error in a proof is reported, not raised
        outcome = Outcome(f"{type(exc).__name__}: {exc}")  # no evidence: failed
    return ClaimResult(claim, outcome, time.perf_counter() - start)


def run_ledger(progress: bool = True, claims: Sequence[Claim] | None = None) -> list[ClaimResult]:
    """Run ``claims`` (default: the module-level :data:`CLAIMS`); progress lines go to stderr."""
    todo = list(CLAIMS if claims is None else claims)
    results = []
    for i, claim in enumerate(todo, 1):
        result = evaluate(claim)
        results.append(result)
        if progress:
            mark = "" if result.as_expected else f"  (expected {claim.expected})"
            status, seconds = result.outcome.status, result.seconds
            print(
                f"[{i:>2}/{len(todo)}] {claim.id:<36} {status:<11} {seconds:6.2f} s{mark}",
                file=sys.stderr,
                flush=True,
            )
    return results


# --- table ----------------------------------------------------------------------------------------

_COLUMNS = (("id", 34), ("location", 24), ("status", 14), ("detail", 70))
#: the narrowest each column gets when the table must fit a terminal, and the order they give way in
_NARROWEST = {"id": 14, "location": 10, "status": 11, "detail": 16}
_SHRINK_ORDER = ("detail", "location", "id", "status")


def column_widths(width: int | None = None) -> tuple[tuple[str, int], ...]:
    """The table's columns and their widths for a table at most ``width`` characters wide (None: the full
    widths of :data:`_COLUMNS`, 148 characters). Columns give way in :data:`_SHRINK_ORDER` down to
    :data:`_NARROWEST`; below that the table is as narrow as it gets (57 characters)."""
    widths = dict(_COLUMNS)
    if width is not None:
        excess = sum(widths.values()) + 2 * (len(widths) - 1) - width
        for name in _SHRINK_ORDER:
            cut = max(0, min(excess, widths[name] - _NARROWEST[name]))
            widths[name] -= cut
            excess -= cut
    return tuple(widths.items())


def _cells(result: ClaimResult, columns=_COLUMNS) -> list[list[str]]:
    mark = "ok" if result.as_expected else f"!! expected {result.claim.expected}"
    detail = result.outcome.detail
    if result.outcome.condition:
        detail += f" CONDITION: {result.outcome.condition}"
    texts = (result.claim.id, result.claim.location, f"{result.outcome.status} {mark}", detail)
    return [textwrap.wrap(text, width) or [""] for text, (_, width) in zip(texts, columns)]


def _counts(results: Sequence[ClaimResult], source: str | None = None) -> Counter:
    """Outcome statuses of ``results`` (of one :data:`~._claims.SOURCES` entry when given)."""
    return Counter(r.outcome.status for r in results if source in (None, r.claim.source))


def _summary(results: Sequence[ClaimResult]) -> str:
    counts = _counts(results)
    line = ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES)
    parts = []
    for source in SOURCES:
        part = _counts(results, source)
        if part:
            shown = ", ".join(f"{part[s]} {s}" for s in STATUSES if part.get(s))
            parts.append(f"the {source}'s statements: {shown}")
    if parts:
        line += f" ({'; '.join(parts)})"
    unexpected = [r.claim.id for r in results if not r.as_expected]
    total = sum(r.seconds for r in results)
    tail = "all as expected" if not unexpected else f"{len(unexpected)} unexpected: " + ", ".join(unexpected)
    return f"{line} — {tail} ({total:.1f} s)"


def format_table(results: Sequence[ClaimResult], width: int | None = None) -> str:
    """Fixed-width table (cells wrapped), one block per claim, then the summary line.

    ``width``: the most characters a line may take (a terminal's width; :func:`column_widths` says how
    the columns give way, and the summary is wrapped to it too); None: the full widths, the summary on
    one line (for a file or a pipe).
    """
    columns = column_widths(width)
    header = "  ".join(name.ljust(w) for name, w in columns).rstrip()
    rule = "  ".join("-" * w for _, w in columns)
    lines = [header, rule]
    for result in results:
        cells = _cells(result, columns)
        for row in range(max(len(c) for c in cells)):
            parts = [(c[row] if row < len(c) else "").ljust(w) for c, (_, w) in zip(cells, columns)]
            lines.append("  ".join(parts).rstrip())
        lines.append("")
    summary = _summary(results)
    lines += [summary] if width is None else textwrap.wrap(summary, max(width, len(rule)))
    return "\n".join(lines)


# --- JSON -----------------------------------------------------------------------------------------


def to_records(results: Sequence[ClaimResult]) -> list[dict]:
    """One JSON-ready dict per claim (``quote``: the paper's words at ``location``).

    ``source``: whose statement the claim is, ``paper`` or ``package`` (:data:`._claims.SOURCES`).
    ``evidence`` lists what the check computed, each piece with its ``kind`` (derivation,
    counterexample, witness, conditional), ``sizes`` (the dimensions covered, e.g. ``{"K": [1, 2, 3, 4]}``)
    and ``established``; a counterexample or witness adds its ``instance`` (exact numbers) and
    ``relation``, a conditional its ``condition``, ``under`` and ``without``. The status is derived
    from it (:func:`._claims.status_of`).
    """
    return [
        {
            "id": r.claim.id,
            "source": r.claim.source,
            "location": r.claim.location,
            "quote": r.claim.quote,
            "statement": r.claim.statement,
            "method": r.claim.method,
            "status": r.outcome.status,
            "expected": r.claim.expected,
            "as_expected": r.as_expected,
            "detail": r.outcome.detail,
            "condition": r.outcome.condition,
            "numbers": r.outcome.numbers,
            "evidence": [e.record() for e in r.outcome.evidence],
            "seconds": round(r.seconds, 4),
        }
        for r in results
    ]


def write_json(results: Sequence[ClaimResult], path: str | os.PathLike) -> None:
    """Write ``{"summary": …, "claims": [...]}`` atomically (:func:`osdn_diag.runtime.atomic.atomic_path`: a
    temporary in the same folder, then a rename; the mode a plain ``open`` would give)."""
    path = os.fspath(path)
    counts = _counts(results)
    payload = {
        "summary": {
            **{s: counts.get(s, 0) for s in STATUSES},
            "by_source": {src: {s: _counts(results, src).get(s, 0) for s in STATUSES} for src in SOURCES},
            "unexpected": [r.claim.id for r in results if not r.as_expected],
            "seconds": round(sum(r.seconds for r in results), 3),
        },
        "claims": to_records(results),
    }
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(strict_json(payload, indent=2, ensure_ascii=False))
        fh.write("\n")
