"""``benchmarks/picard_convergence.py``, the evidence behind the token-parallel phase 1's ``ROUNDS`` and
``TOL_D``: its rounds must converge to the exact sequential sweep, and say so when they do not."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def script(benchmark_script):
    return benchmark_script("picard_convergence")


def test_rounds_converge_to_the_exact_sweep_at_small_eta(script, capsys):
    rows = script.main(["--T", "300", "--K", "16", "--sequences", "3", "--eta", "0.003", "--rounds", "6"])
    err = [r["d_error"] for r in rows]
    assert all(b < a for a, b in zip(err, err[1:])), err      # each round closer to the sweep
    assert err[-1] < 1e-12 and err[0] > 1e-8                  # from a real first-guess error to fp64's
    assert "settles at round" in capsys.readouterr().out
    for r in rows[:3]:  # the error estimate is tight while the error is far above fp64's rounding
        assert r["d_error"] <= r["estimate"] <= 1.5 * r["d_error"], r
        assert r["d_error_max"] <= r["estimate_max"] <= 1.5 * r["d_error_max"], r


def test_large_eta_is_reported_unsettled(script, capsys):
    rows = script.main(["--T", "300", "--K", "16", "--sequences", "2", "--eta", "3.0", "--rounds", "2"])
    # 1e-5: the documented settling tolerance TOL_D (README, "OSDN layers and models")
    assert len(rows) == 2 and all(2 * r["estimate_max"] > 1e-5 for r in rows)
    assert "not settled in 2 rounds" in capsys.readouterr().out
