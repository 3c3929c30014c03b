"""Reading the report's markdown tables back, for the tests that recompute their numbers."""

from __future__ import annotations


def table_after(report: str, heading: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the first markdown table after the line ``## heading``."""
    lines = report.splitlines()
    start = lines.index(f"## {heading}")
    rows = []
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip()[1:-1].split(" | ")])
        elif rows:
            break
    assert len(rows) >= 3 and set("".join(rows[1])) == {"-", "|"}, f"no table under '## {heading}'"
    return rows[0], rows[2:]
