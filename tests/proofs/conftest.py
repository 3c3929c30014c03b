"""The claims ledger, run once for every test of this folder (a full run takes about 8 s on 2 CPU cores)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="session")
def ledger_results():
    """Every claim's :class:`ClaimResult`, in ledger order."""
    from osdn_diag.proofs import ledger

    return ledger.run_ledger(progress=False)


@pytest.fixture(scope="session")
def ledger_json(ledger_results, tmp_path_factory):
    """The ledger as ``write_json`` writes it, read back: ``{"summary": …, "claims": [...]}``."""
    from osdn_diag.proofs import ledger

    path = tmp_path_factory.mktemp("ledger") / "ledger.json"
    ledger.write_json(ledger_results, path)
    return json.loads(path.read_text(encoding="utf-8"))
