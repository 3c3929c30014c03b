"""Strict JSON for every file the package writes.

Python's ``json`` writes a non-finite float as the bare token ``NaN``/``Infinity``, which is not JSON:
strict parsers (JavaScript's ``JSON.parse``, jq, most non-Python readers) reject the whole file. A
value that is not a number — a geometric mean over no tokens, an accuracy over no queries — is written
as ``null`` instead, and ``allow_nan=False`` makes any that slips through an error rather than a file
that only Python can read.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["dumps", "finite_or_null"]


def finite_or_null(obj: Any) -> Any:
    """``obj`` with every non-finite float (at any depth of dicts, lists and tuples) replaced by
    ``None``; tuples become lists, as JSON has them."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs) -> str:
    """``json.dumps`` of ``obj`` with non-finite floats written as ``null``; strict JSON."""
    return json.dumps(finite_or_null(obj), allow_nan=False, **kwargs)
