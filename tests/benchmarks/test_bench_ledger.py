"""``benchmarks/bench_ledger.py``: both paths run, their evidence is compared, and the comparison decides
the exit status."""

from __future__ import annotations

import json
import sys

import pytest

CLAIMS = "lemma-4.1-gradient,comba-gated-one-token"


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script("bench_ledger")


def _main(bench, monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["bench_ledger.py", *argv])
    return bench.main()


def test_times_both_paths_and_finds_the_evidence_identical(bench, monkeypatch, tmp_path, capsys):
    # Which path each run takes, counted: the shipped run hands polynomials to the ring, the
    # baseline refuses every one of them (and so expands). The time each takes is the benchmark's
    # finding, not a test's: Lemma 4.1's gradient takes 6-10 times longer expanded on an idle
    # machine, under twice as long beside a busy test worker.
    from osdn_diag.proofs import _sym

    taken = {"ring": 0, "expand": 0}

    def counted(path, fn):
        def call(expr):
            taken[path] += 1
            return fn(expr)
        return call

    monkeypatch.setattr(_sym, "_polynomial", counted("ring", _sym._polynomial))
    monkeypatch.setattr(bench, "_no_ring", counted("expand", bench._no_ring))
    out = tmp_path / "ledger.json"
    assert _main(bench, monkeypatch, "--claims", CLAIMS, "--json", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["claims"] == 2 and data["identical"] is True
    assert set(data["per_claim"]) == set(CLAIMS.split(","))
    assert data["ratio"] == pytest.approx(data["seconds_expand"] / data["seconds_ring"], rel=0.01)
    assert taken["ring"] > 0 and taken["expand"] > 0, taken
    assert "outcomes and evidence identical: True" in capsys.readouterr().out


def test_different_evidence_fails(bench, monkeypatch):
    calls = iter([{"a": 1}, {"a": 2}])
    monkeypatch.setattr(bench, "_evidence", lambda results: next(calls))
    assert _main(bench, monkeypatch, "--claims", "lemma-4.1-gradient") == 1


def test_an_unknown_claim_is_an_error(bench, monkeypatch, capsys):
    assert _main(bench, monkeypatch, "--claims", "no-such-claim") == 2
    assert "no-such-claim" in capsys.readouterr().err
