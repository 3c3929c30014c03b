"""docs/ledger.md is generated from the ledger and kept up to date; quotes are the paper's words."""

from __future__ import annotations

import os
import unicodedata
from pathlib import Path

import pytest
import sympy as sp

from osdn_diag.proofs import inconsistencies, ledger, ledger_doc
from osdn_diag.proofs._claims import Claim, Outcome
from osdn_diag.proofs._evidence import Derivation
from osdn_diag.proofs._sym import vanishes

DOC = Path(__file__).resolve().parents[2] / "docs" / "ledger.md"


def test_docs_ledger_is_up_to_date(ledger_json):
    expected = ledger_doc.format_markdown(ledger_json["claims"])
    assert DOC.read_text(encoding="utf-8") == expected, (
        "docs/ledger.md is out of date: regenerate it with `python -m osdn_diag.proofs.ledger_doc docs/ledger.md`"
    )


def test_document_lists_every_claim_with_its_sizes(ledger_json):
    text = ledger_doc.format_markdown(ledger_json["claims"])
    for record in ledger_json["claims"]:
        assert f"\n## {record['id']}\n" in text
        assert f"- **Status:** {record['status']}" in text
    assert "K = 1..4, V ∈ {1, 2}, 32 steps" in text  # Lemma 4.1's explicit grid
    assert "*unit keys (‖k_t‖² = 1, so max(‖k_t‖², ε) = 1)*" in text  # a conditional's hypothesis


def test_every_claim_quotes_the_paper():
    assert all(c.quote for c in ledger.CLAIMS), [c.id for c in ledger.CLAIMS if not c.quote]
    with pytest.raises(ValueError, match="whitespace"):
        Claim(id="x", location="l", statement="s", method="m", expected="verified", check=lambda: None, quote=" q")


def _normalise(text: str) -> str:
    """Mathematical letters to plain ones (NFKC), invisible operators and all whitespace removed."""
    text = unicodedata.normalize("NFKC", text)
    return "".join(ch for ch in text if not ch.isspace() and unicodedata.category(ch) != "Cf")


@pytest.mark.skipif(not os.environ.get("OSDN_PAPER_TEXT"), reason="set OSDN_PAPER_TEXT to the paper as text")
def test_quotes_are_verbatim_from_the_paper():
    paper = _normalise(Path(os.environ["OSDN_PAPER_TEXT"]).read_text(encoding="utf-8"))
    missing = [c.id for c in ledger.CLAIMS if _normalise(c.quote) not in paper]
    assert not missing, f"quotes not found in the paper: {missing}"
    passages = [key for key, text in inconsistencies.PASSAGES.items() if _normalise(text) not in paper]
    assert not passages, f"passages not found in the paper: {passages}"


def test_main_writes_the_document(monkeypatch, tmp_path, capsys):
    claim = Claim(id="only", location="Sec. 0", statement="s", method="m", expected="verified",
                  check=lambda: Outcome("d", [Derivation("p", {"1 = 1": vanishes(sp.Integer(1), 1)}, sizes={"K": (1, 2)})]), quote="q")
    monkeypatch.setattr(ledger, "CLAIMS", [claim])
    path = tmp_path / "ledger.md"
    assert ledger_doc.main([str(path)]) == 0
    text = path.read_text(encoding="utf-8")
    assert "**1 claims: 1 verified, 0 refuted, 0 conditional.**" in text and "K ∈ {1, 2}, 1 steps" in text
    bad = Claim(id="bad", location="l", statement="s", method="m", expected="refuted",
                check=lambda: Outcome("d", [Derivation("p", {"1 = 1": vanishes(sp.Integer(1), 1)})]))
    monkeypatch.setattr(ledger, "CLAIMS", [bad])
    assert ledger_doc.main([str(tmp_path / "other.md")]) == 1
    assert not (tmp_path / "other.md").exists()
