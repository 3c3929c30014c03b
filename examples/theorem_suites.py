"""Run the theorem suites: the symbolic claims ledger, then (optionally) the randomized property suites.

    python examples/theorem_suites.py                   # sympy derivations: every claim's status
    python examples/theorem_suites.py --properties dev  # + hypothesis properties (profile dev/ci/thorough)

The ledger is what ``osdn-diag prove`` prints; here it is driven from Python so a claim's outcome can
be inspected (``result.outcome.status``, ``result.outcome.detail``). The property suites live in the
repository's ``tests/math`` (the recurrences, Lemma 4.1, Theorem D.7, Corollary A.2, the chunk form)
and ``tests/proofs``; they need a source checkout.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

from osdn_diag.proofs import ledger


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--properties", choices=("dev", "ci", "thorough"),
                   help="also run the hypothesis property suites with this profile")
    a = p.parse_args()

    results = ledger.run_ledger(progress=False)
    for r in results:
        mark = "ok " if r.as_expected else "!! "
        print(f"{mark}{r.claim.id:28s} {r.outcome.status:12s} {r.claim.location}")
    print(dict(Counter(r.outcome.status for r in results)))
    status = 0 if all(r.as_expected for r in results) else 1

    if a.properties:
        root = Path(__file__).resolve().parent.parent
        env = dict(os.environ, HYPOTHESIS_PROFILE=a.properties)
        suites = [str(root / "tests" / "math"), str(root / "tests" / "proofs")]
        status |= subprocess.call([sys.executable, "-m", "pytest", "-q", *suites], cwd=root, env=env)
    return status


if __name__ == "__main__":
    sys.exit(main())
