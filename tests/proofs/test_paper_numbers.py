"""The numeric claims: float recomputation of a few figures, and the checks catch a wrong cell."""

from __future__ import annotations

from fractions import Fraction

import pytest

from osdn_diag.proofs import paper_numbers as pn


def test_round_half_up():
    assert pn.round_half_up(Fraction(5505, 100000), 3) == Fraction(55, 1000)
    assert pn.round_half_up(Fraction(1, 2), 0) == 1
    assert pn.round_half_up(Fraction(-1937, 100), 0) == -19
    assert pn.round_half_up(Fraction(-1, 2), 0) == 0  # half up, not away from zero


def test_floats_agree_with_the_exact_figures():
    assert 100 * (0.198 - 0.150) / 0.150 == pytest.approx(32.0)
    assert 100 * (0.265 - 0.432) / 0.432 == pytest.approx(-38.657, abs=1e-3)
    assert 24 * 8 * 1025 / 340e6 * 100 == pytest.approx(0.05788, abs=1e-5)
    assert 24 * 16 * 2049 / 1.3e9 * 100 == pytest.approx(0.06052, abs=1e-5)
    assert 7.85e6 / (48 * 24 * 8) == pytest.approx(851.78, abs=1e-2)
    assert 100 * (803.0 / 761.1 - 1) == pytest.approx(5.5052, abs=1e-4)


def test_averages_catch_a_wrong_cell(monkeypatch):
    table = dict(pn.TABLE_7)
    table["DeltaNet"] = table["DeltaNet"].replace("0.155", "0.157", 1)  # single-pass average off by 0.0027
    monkeypatch.setattr(pn, "TABLE_7", table)
    outcome = pn.check_averages()
    assert outcome.status == "failed" and "Table 7, DeltaNet: Single" in outcome.detail


def test_headlines_catch_a_wrong_percentage(monkeypatch):
    wrong = tuple((w, s, b, a, p + 1 if w == "OSDN q_geo" else p) for w, s, b, a, p in pn._HEADLINES)
    monkeypatch.setattr(pn, "_HEADLINES", wrong)
    outcome = pn.check_headlines()
    assert outcome.status == "failed" and "OSDN q_geo" in outcome.detail


def test_throughput_catches_a_wrong_delta(monkeypatch):
    table = dict(pn.TABLE_19_20)
    table["OSKDA"] = ("803.0", "2665.9", "5.6")
    monkeypatch.setattr(pn, "TABLE_19_20", table)
    outcome = pn.check_throughput()
    assert outcome.status == "failed" and "OSKDA" in outcome.detail
