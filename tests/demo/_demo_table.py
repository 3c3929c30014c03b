"""The table ``osdn-diag demo`` prints, read back from its standard output (shared by the demo tests)."""

from __future__ import annotations


def printed_table(stdout: str) -> tuple[str, list[list[str]]]:
    """``(header line, rows)``: the line starting ``model `` and the whitespace-split lines below it,
    up to the first blank line."""
    lines = stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("model "))
    body = []
    for ln in lines[head + 1:]:
        if not ln.strip():
            break
        body.append(ln.split())
    return lines[head], body
