"""The distribution lists every subpackage (an explicit list, since proofs/ is mapped into the package)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "osdn_diag").rglob("__init__.py")
    } | {"osdn_diag.proofs"}
    assert found == listed
