"""The ``osdn-diag`` command (also ``python -m osdn_diag``)."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _cmd_prove(args: argparse.Namespace) -> int:
    from .proofs import ledger

    results = ledger.run_ledger(progress=not args.quiet)
    print(ledger.format_table(results))
    if args.json:
        ledger.write_json(results, args.json)
        print(f"\nledger written to {args.json}")
    failed = [r for r in results if not r.as_expected]
    if failed:
        print(
            "\nunexpected outcome for: " + ", ".join(r.claim.id for r in failed),
            file=sys.stderr,
        )
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="osdn-diag",
        description="Residual-contraction diagnostics for delta-rule linear attention.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prove = sub.add_parser(
        "prove",
        help="run the symbolic proofs and print the claims ledger",
        description="Run every sympy derivation in proofs/ and print the claims ledger. Exits "
        "non-zero if any claim's outcome differs from the one recorded in the ledger.",
    )
    prove.add_argument("--json", metavar="FILE", help="also write the ledger as JSON to FILE")
    prove.add_argument("-q", "--quiet", action="store_true", help="no per-claim progress lines")
    prove.set_defaults(func=_cmd_prove)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
