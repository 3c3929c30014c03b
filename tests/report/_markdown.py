"""Reading the report's markdown tables back, for the tests that recompute their numbers."""

from __future__ import annotations


def table_after(report: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the first markdown table under ``heading``: a whole heading line
    (``"### Comba"``), or a title taken as ``"## title"``. The search stops at the next heading of the
    same or a higher level."""
    line = heading if heading.startswith("#") else f"## {heading}"
    level = len(line) - len(line.lstrip("#"))
    lines = report.splitlines()
    start = lines.index(line)
    rows = []
    for text in lines[start + 1:]:
        if text.startswith("#") and len(text) - len(text.lstrip("#")) <= level:
            break
        if text.startswith("|"):
            rows.append([cell.strip() for cell in text.strip()[1:-1].split(" | ")])
        elif rows:
            break
    assert len(rows) >= 3 and set("".join(rows[1])) == {"-", "|"}, f"no table under {line!r}"
    return rows[0], rows[2:]
