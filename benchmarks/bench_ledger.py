"""The claims ledger (``osdn-diag prove``): every claim's check, with identities decided in sympy's
sparse polynomial ring (the shipped path) and, as the baseline in the same process, by expanding them.

    python benchmarks/bench_ledger.py [--claims ID,ID...] [--json FILE]

``proofs/_sym.py::vanishes`` evaluates a numerator made of symbols, rationals, sums, products and
non-negative integer powers in ``Q[symbols]``; the baseline forces every identity through
``sympy.expand``, as before. Both runs must give every claim the same outcome and the same evidence
(the ledger's JSON records, less their timings), or the script exits with status 1. Prints each claim's seconds
under both, the totals and their ratio; ``--json`` writes the same numbers. CPU only (sympy).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from _common import write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from osdn_diag.proofs import _sym, ledger  # noqa: E402


def _no_ring(expr):
    raise _sym._NotPolynomial(expr)


def _evidence(results) -> list[dict]:
    """The ledger's JSON records (:func:`ledger.to_records`) without their timings."""

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "seconds"}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return strip(ledger.to_records(results))


def _run(claims, expand: bool):
    saved = _sym._polynomial
    if expand:
        _sym._polynomial = _no_ring
    try:
        t = time.perf_counter()
        results = ledger.run_ledger(progress=False, claims=claims)
        return results, time.perf_counter() - t
    finally:
        _sym._polynomial = saved


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--claims", help="comma-separated claim ids (default: all)")
    p.add_argument("--json")
    args = p.parse_args()
    claims = list(ledger.CLAIMS)
    if args.claims:
        wanted = args.claims.split(",")
        unknown = sorted(set(wanted) - {c.id for c in claims})
        if unknown:
            print(f"error: unknown claim id(s) {', '.join(unknown)}", file=sys.stderr)
            return 2
        claims = [c for c in claims if c.id in wanted]
    print(f"{len(claims)} claims; Python {platform.python_version()}, {platform.processor() or platform.machine()}")
    ring, t_ring = _run(claims, expand=False)
    expand, t_expand = _run(claims, expand=True)
    same = _evidence(ring) == _evidence(expand)
    rows = sorted(zip(ring, expand), key=lambda re: -re[1].seconds)
    print(f"{'claim':<38} {'ring s':>8} {'expand s':>9} {'ratio':>7}")
    for r, e in rows[:15]:
        print(f"{r.claim.id:<38} {r.seconds:8.2f} {e.seconds:9.2f} {e.seconds / max(r.seconds, 1e-9):6.1f}x")
    print(f"{'all claims (wall)':<38} {t_ring:8.2f} {t_expand:9.2f} {t_expand / t_ring:6.1f}x")
    print(f"outcomes and evidence identical: {same}")
    if args.json:
        write_json(args.json, {
            "claims": len(claims),
            "seconds_ring": round(t_ring, 3),
            "seconds_expand": round(t_expand, 3),
            "ratio": round(t_expand / t_ring, 2),
            "identical": same,
            "per_claim": {r.claim.id: {"ring": round(r.seconds, 4), "expand": round(e.seconds, 4)} for r, e in rows},
        })
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
