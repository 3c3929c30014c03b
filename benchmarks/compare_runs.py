"""Two run directories side by side: do they hold the same results?

    python benchmarks/compare_runs.py RUN_A RUN_B [--rtol 0] [--atol 0]

Compares every number of ``summary.json`` (largest relative difference, and where) and the rows of
``residuals.parquet`` (sorted by prompt, layer, head, position; a partitioned table from ``torchrun``
reads as one). What describes how a run was made rather than what it found — text such as the replay's
device or a precision's name, and ``world_size``, ``run_id`` — is metadata: its differences are listed
apart and never make two runs' results different. Differences of at
most ``--atol`` count as none (a solver's certificate near 0 moves with summation order). Exit status
0 when every difference is within ``--rtol`` (default 0: bitwise equal), 1 otherwise. Used to check
that a run spread over several GPUs (``--device-map``) or sharded over ranks (``torchrun``) gives the
single-GPU run's answers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def _leaves(obj, prefix=""):
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _leaves(value, f"{prefix}[{i}]")
    else:
        yield prefix, obj


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _rel(a, b, atol: float) -> float:
    if not _is_number(a) or not _is_number(b):
        return 0.0 if a == b else math.inf
    if math.isnan(a) and math.isnan(b):
        return 0.0
    return 0.0 if abs(a - b) <= atol else abs(a - b) / max(abs(a), abs(b))


#: numeric summary keys that describe how a run was made rather than what it found
NOT_RESULTS = ("world_size", "run_id")


def _is_metadata(key: str, a, b) -> bool:
    """Text (a device, a dtype's name, a backend) and the keys of :data:`NOT_RESULTS` describe the run;
    numbers, booleans and nulls are what it found."""
    return key in NOT_RESULTS or isinstance(a, str) or isinstance(b, str)


def compare(run_a: Path, run_b: Path, atol: float = 0.0) -> dict:
    """``{"summary": (max rel diff, key), "residuals": (max rel diff, column), "rows": (n_a, n_b),
    "metadata": [(key, value_a, value_b), ...]}`` — the metadata that differs, which the first three
    leave out."""
    import numpy as np
    import pyarrow.parquet as pq

    sa, sb = (dict(_leaves(json.loads((run / "summary.json").read_text()))) for run in (run_a, run_b))
    worst, metadata = (0.0, None), []
    for key in sorted(sa.keys() | sb.keys()):
        a, b = sa.get(key), sb.get(key)
        if _is_metadata(key, a, b):
            if key not in NOT_RESULTS and (key not in sa or key not in sb or a != b):
                metadata.append((key, a, b))
            continue
        d = _rel(a, b, atol) if key in sa and key in sb else math.inf
        worst = max(worst, (d, key), key=lambda x: x[0])
    keys = [(k, "ascending") for k in ("prompt", "layer", "head", "pos")]
    ta = pq.read_table(run_a / "residuals.parquet").sort_by(keys)
    tb = pq.read_table(run_b / "residuals.parquet").sort_by(keys)
    col_worst = (0.0, None)
    for name in sorted(set(ta.column_names) | set(tb.column_names)):
        if ta.num_rows != tb.num_rows:
            col_worst = max(col_worst, (math.inf, name), key=lambda x: x[0])
            continue
        if name not in ta.column_names or name not in tb.column_names:
            # a column that one table leaves out is the same as one that is null throughout (runs
            # before series 31 wrote every registered column, null where no layer filled it)
            held = ta if name in ta.column_names else tb
            if held[name].null_count != held.num_rows:
                col_worst = max(col_worst, (math.inf, name), key=lambda x: x[0])
            continue
        a, b = ta[name].to_numpy(), tb[name].to_numpy()
        if a.dtype.kind != "f" or b.dtype.kind != "f":
            d = 0.0 if np.array_equal(a, b) else math.inf
        else:
            a, b = a.astype(np.float64), b.astype(np.float64)
            if not np.array_equal(np.isnan(a), np.isnan(b)):
                d = math.inf
            else:
                ok = ~np.isnan(a)
                diff = np.abs(a[ok] - b[ok])
                den = np.maximum(np.maximum(np.abs(a[ok]), np.abs(b[ok])), 1e-300)
                d = float(np.max(np.where(diff <= atol, 0.0, diff / den), initial=0.0))
        col_worst = max(col_worst, (d, name), key=lambda x: x[0])
    return {"summary": worst, "residuals": col_worst, "rows": (ta.num_rows, tb.num_rows), "metadata": metadata}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    p.add_argument("--rtol", type=float, default=0.0, help="largest relative difference allowed")
    p.add_argument("--atol", type=float, default=0.0, help="absolute differences up to this count as none")
    a = p.parse_args(argv)
    for name, run in (("RUN_A", a.run_a), ("RUN_B", a.run_b)):
        missing = [f for f in ("summary.json", "residuals.parquet") if not (run / f).exists()]
        if missing:
            p.error(f"{name} {str(run)!r}: no {' or '.join(missing)} (expected a finished run directory)")
    r = compare(a.run_a, a.run_b, a.atol)
    (ds, ks), (dr, kr), (na, nb) = r["summary"], r["residuals"], r["rows"]
    print(f"summary.json: largest relative difference {ds:.3g}" + (f" ({ks})" if ds else ""))
    print(f"residuals.parquet: {na:,} vs {nb:,} rows; largest relative difference {dr:.3g}"
          + (f" ({kr})" if dr else ""))
    for key, va, vb in r["metadata"]:
        print(f"metadata (not compared as a result): {key}: {va!r} vs {vb!r}")
    ok = ds <= a.rtol and dr <= a.rtol
    print("same results" if ok else f"DIFFERENT (rtol {a.rtol:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
