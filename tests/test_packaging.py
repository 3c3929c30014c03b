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


def test_builtin_models_ship_as_package_data():
    """Every file of every built-in model matches a package-data pattern (else a wheel lacks it)."""
    import fnmatch

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["osdn_diag"]
    files = [p.relative_to(ROOT / "osdn_diag").as_posix() for p in (ROOT / "osdn_diag" / "builtin").rglob("*") if p.is_file()]
    assert any(f.endswith("model.safetensors") for f in files)
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not missing, f"built-in files not in package-data: {missing}"
