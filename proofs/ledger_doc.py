"""``docs/ledger.md``: the claims ledger as a document, generated from a run of the ledger.

    python -m osdn_diag.proofs.ledger_doc docs/ledger.md

writes, for every claim in ledger order, its id, the paper location and quote, what is checked and
how, the status the evidence establishes (with the added hypothesis of a conditional claim), and the
sizes every piece of evidence covered. Nothing run-dependent (times, floating-point figures) goes in,
so the file changes only when the ledger does; the test suite regenerates it and compares.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Sequence

from ..runtime.atomic import atomic_path
from ._claims import SOURCES, STATUSES
from ._evidence import format_sizes

__all__ = ["format_markdown", "main"]

_COMMAND = "python -m osdn_diag.proofs.ledger_doc docs/ledger.md"
#: how the document names each source of statements
_SOURCE_WORDS = {
    "paper": "the paper's statements",
    "package": "the package's own statements (the paper's results asked of fla's further kernel families)",
}


def _cell(text: str) -> str:
    """Text for a Markdown table cell: pipes escaped, on one line."""
    return " ".join(text.replace("|", "\\|").split())


def _pieces(records: Sequence[dict], within: str = "") -> list[str]:
    """One line per piece of evidence: its kind, label and the sizes it covered."""
    lines = []
    for record in records:
        kind = within + record["kind"]
        if record["kind"] == "conditional":
            lines.append(f"{kind}: *{record['condition']}*")
            lines += _pieces(record["under"], "under the condition, ")
            lines += _pieces(record["without"], "without it, ")
            continue
        sizes = format_sizes(record["sizes"]) if record["sizes"] else "no sizes (scalars or dimension-free)"
        steps = f", {record['steps']} steps" if record["kind"] == "derivation" else ""
        lines.append(f"{kind} — {record['label']}: {sizes}{steps}")
    return lines


def format_markdown(records: Sequence[dict]) -> str:
    """The document for ``records`` as :func:`.ledger.to_records` returns them."""
    counts = Counter(r["status"] for r in records)
    summary = ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES if s != "failed" or counts.get(s))
    by_source = []
    for source in SOURCES:
        part = Counter(r["status"] for r in records if r.get("source", "paper") == source)
        if part:
            shown = ", ".join(f"{part[s]} {s}" for s in STATUSES if part.get(s))
            by_source.append(f"{_SOURCE_WORDS[source]} ({sum(part.values())}): {shown}")
    out = [
        "# The claims ledger",
        "",
        f"Generated from the ledger by `{_COMMAND}`; edit the proof modules in `proofs/`, not this file "
        "(the test suite fails when it is out of date). `osdn-diag prove` runs the same checks.",
        "",
        "A claim's status is derived from the evidence its check computes (`proofs/_evidence.py`): a "
        "counterexample refutes; a hypothesis shown to be needed makes it conditional; symbolic derivations "
        "(with the sizes they covered) and exact witnesses alone verify. A derivation at finite sizes proves "
        "the statement at those sizes; where the argument extends to every size (induction, a "
        "dimension-free algebra), the claim's text says so. Floating-point sweeps are supporting numbers, "
        "never evidence.",
        "",
        f"**{len(records)} claims: {summary}.** By whose statement: {'; '.join(by_source)}. A refuted "
        "statement of the package's own is not an error of the paper.",
        "",
        "| id | paper location | statement of | status |",
        "| --- | --- | --- | --- |",
    ]
    for r in records:
        out.append(f"| [`{r['id']}`](#{r['id'].replace('.', '')}) | {_cell(r['location'])} | "
                   f"{r.get('source', 'paper')} | {r['status']} |")
    for r in records:
        status = r["status"] + (f" — condition: {r['condition']}" if r["condition"] else "")
        out += [
            "",
            f"## {r['id']}",
            "",
            f"- **Location:** {r['location']}",
            f"- **Paper:** “{r['quote']}”" if r["quote"] else "- **Paper:** (no quote)",
            f"- **Checked:** {r['statement']}",
            f"- **How:** {r['method']}",
            f"- **Status:** {status}",
            "- **Covered:**",
            *(f"  - {line}" for line in _pieces(r["evidence"])),
        ]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ledger and write the document to the path given (``docs/ledger.md`` by default)."""
    from . import ledger  # the ledger imports every proof module; keep it out of import time

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) > 1:
        print(f"usage: {_COMMAND}", file=sys.stderr)
        return 2
    path = argv[0] if argv else os.path.join("docs", "ledger.md")
    results = ledger.run_ledger(progress=False)
    unexpected = [r.claim.id for r in results if not r.as_expected]
    if unexpected:
        print(f"not written: claims with unexpected outcomes: {', '.join(unexpected)}", file=sys.stderr)
        return 1
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.write(format_markdown(ledger.to_records(results)))
    print(f"wrote {path} ({len(results)} claims)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
