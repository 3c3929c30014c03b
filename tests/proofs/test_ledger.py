"""The claims ledger: outcomes, table, JSON, and the ``osdn-diag prove`` command."""

from __future__ import annotations

import json
import os

import pytest

from osdn_diag.cli import main
from osdn_diag.proofs import ledger
import sympy as sp

from osdn_diag.proofs._evidence import Conditional, Counterexample, Derivation
from osdn_diag.proofs._sym import vanishes
from osdn_diag.proofs.ledger import Claim, Outcome

FIELDS = {
    "id", "location", "statement", "method", "status", "expected", "detail", "condition", "numbers", "evidence",
}


@pytest.fixture
def results(ledger_results):
    return ledger_results


def _claim(claim_id: str, check, expected: str = "verified") -> Claim:
    return Claim(id=claim_id, location="test", statement="s", method="m", expected=expected, check=check)


def _verified(detail: str = "fine") -> Outcome:
    return Outcome(detail, [Derivation("trivial", {"1 = 1": vanishes(sp.Integer(1), 1)})])


def _refuted(detail: str = "wrong status") -> Outcome:
    return Outcome(detail, [Counterexample("1 ≤ 0", 1, "<=", 0)])


def test_ids_are_unique():
    ids = [c.id for c in ledger.CLAIMS]
    assert len(ids) == len(set(ids))


def test_ids_fit_the_table_column():
    width = dict(ledger._COLUMNS)["id"]
    assert all(len(c.id) <= width for c in ledger.CLAIMS), [c.id for c in ledger.CLAIMS if len(c.id) > width]


@pytest.mark.parametrize("claim", ledger.CLAIMS, ids=lambda c: c.id)
def test_claim_outcome_matches_expected(results, claim):
    (result,) = [r for r in results if r.claim.id == claim.id]
    assert result.outcome.status != "failed", result.outcome.detail
    assert result.outcome.status == claim.expected, result.outcome.detail
    assert result.as_expected
    if result.outcome.status == "conditional":
        assert result.outcome.condition
    json.dumps(result.outcome.numbers)  # JSON-serialisable


def test_table_lists_every_claim_and_summary(results):
    table = ledger.format_table(results)
    for r in results:
        assert r.claim.id in table
    n = {s: sum(r.outcome.status == s for r in results) for s in ("verified", "refuted", "conditional")}
    summary = f"{n['verified']} verified, {n['refuted']} refuted, {n['conditional']} conditional, 0 failed"
    assert summary in table
    assert "all as expected" in table


def test_write_json_round_trips_atomically(results, tmp_path):
    path = tmp_path / "ledger.json"
    ledger.write_json(results, path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert [c["id"] for c in data["claims"]] == [r.claim.id for r in results]
    for record in data["claims"]:
        assert FIELDS <= set(record)
        assert record["status"] == record["expected"]
    assert data["summary"]["failed"] == 0 and data["summary"]["unexpected"] == []
    assert os.listdir(tmp_path) == ["ledger.json"]  # no temp file left behind


def test_write_json_leaves_no_temp_file_on_error(tmp_path):
    unserialisable = Outcome("d", numbers={"n": object()})
    bad = ledger.ClaimResult(_claim("x", lambda: None), unserialisable, 0.0)
    with pytest.raises(TypeError):
        ledger.write_json([bad], tmp_path / "ledger.json")
    assert os.listdir(tmp_path) == []


def test_exception_becomes_failed():
    def boom() -> Outcome:
        raise RuntimeError("no proof today")

    (result,) = ledger.run_ledger(progress=False, claims=[_claim("boom", boom)])
    assert result.outcome.status == "failed"
    assert "no proof today" in result.outcome.detail
    assert not result.as_expected


def test_non_outcome_becomes_failed():
    (result,) = ledger.run_ledger(progress=False, claims=[_claim("none", lambda: "verified")])
    assert result.outcome.status == "failed"


def test_progress_goes_to_stderr(capsys):
    ledger.run_ledger(progress=True, claims=[_claim("ok", _verified)])
    out, err = capsys.readouterr()
    assert out == "" and "ok" in err and "verified" in err


def test_cli_prove_succeeds_and_writes_json(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert main(["prove", "--json", str(path), "-q"]) == 0
    data = json.loads(path.read_text(encoding="utf-8"))
    assert len(data["claims"]) == len(ledger.CLAIMS)
    assert "0 failed" in capsys.readouterr().out


@pytest.mark.parametrize(
    "check",
    [_refuted, lambda: 1 / 0],
    ids=["wrong-status", "raises"],
)
def test_cli_prove_fails_on_unexpected_outcome(monkeypatch, tmp_path, capsys, check):
    claims = [_claim("good", _verified), _claim("bad", check)]
    monkeypatch.setattr(ledger, "CLAIMS", claims)
    assert main(["prove", "--json", str(tmp_path / "out.json"), "-q"]) == 1
    captured = capsys.readouterr()
    assert "bad" in captured.err and "good" not in captured.err
    assert "1 unexpected: bad" in captured.out


def test_claim_and_outcome_validate_status():
    with pytest.raises(TypeError, match="cannot be given"):
        Outcome("verified", "x")  # a status cannot be typed in: the second argument is the evidence
    with pytest.raises(TypeError):
        Outcome("x", ["verified"])
    with pytest.raises(ValueError):
        Conditional("", [Derivation("d", {"s": vanishes(sp.Integer(1), 1)})], [Counterexample("c", 1, "<=", 0)])  # states no condition
    with pytest.raises(ValueError):
        _claim("x", lambda: None, expected="failed")


# --- the table fits the terminal ----------------------------------------------------------------------


@pytest.mark.parametrize("width", [57, 80, 100, 147])
def test_table_fits_the_width_it_is_given(results, width):
    text = ledger.format_table(results, width=width)
    assert max(len(line) for line in text.splitlines()) <= width
    # nothing is lost: each claim's cells, wrapped to their columns, hold its id and detail whole, and the
    # summary's words are all there
    columns = ledger.column_widths(width)
    for r in results:
        id_cell, _, status_cell, detail_cell = ledger._cells(r, columns)
        assert "".join(id_cell) == r.claim.id and " ".join(status_cell).startswith(r.outcome.status)
        detail = r.outcome.detail + (f" CONDITION: {r.outcome.condition}" if r.outcome.condition else "")
        assert "".join("".join(detail_cell).split()) == "".join(detail.split())
    assert " ".join(text.split()).endswith(" ".join(ledger._summary(results).split()))


def test_table_full_width_without_a_width(results):
    lines = ledger.format_table(results).splitlines()
    assert len(lines[1]) == sum(w for _, w in ledger._COLUMNS) + 2 * (len(ledger._COLUMNS) - 1) == 148
    assert lines[-1].startswith(f"{sum(r.outcome.status == 'verified' for r in results)} verified")
    assert ledger.column_widths(None) == ledger._COLUMNS
    assert ledger.column_widths(200) == ledger._COLUMNS  # a wide terminal changes nothing
    assert sum(w for _, w in ledger.column_widths(10)) + 6 == 57  # the narrowest it gets


@pytest.mark.parametrize("tty, wide, expected", [(True, False, 80), (True, True, None), (False, False, None)])
def test_cli_prove_fits_a_terminal_unless_wide_or_piped(monkeypatch, capsys, tty, wide, expected):
    seen = []
    monkeypatch.setattr(ledger, "run_ledger", lambda progress=True: [ledger.evaluate(_claim("ok", _verified))])
    real = ledger.format_table
    monkeypatch.setattr(ledger, "format_table", lambda results, width=None: seen.append(width) or real(results, width))
    monkeypatch.setattr("sys.stdout.isatty", lambda: tty)
    monkeypatch.setattr("shutil.get_terminal_size", lambda fallback=(80, 24): os.terminal_size((80, 24)))
    assert main(["prove", "-q"] + (["--wide"] if wide else [])) == 0
    assert seen == [expected]
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= (80 if expected else 148)
