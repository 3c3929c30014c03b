"""Theorem D.5 with Lemma D.3, and Corollary D.8, against plain float64 numerics (no sympy).

The references below share no code with :mod:`proofs.theorem_d5` / :mod:`proofs.corollary_d8`: the
population loss is an average over samples, ``f*`` comes from ``numpy.linalg.lstsq`` and ``Σ†`` from
``numpy.linalg.pinv``.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy as sp

from osdn_diag.proofs import corollary_d8, theorem_d5

RNG = np.random.default_rng(22)


def _problem(K, V, m, rank):
    """m samples whose keys span a ``rank``-dimensional subspace of R^K (Σ singular when rank < K)."""
    basis = RNG.normal(size=(K, rank))
    keys = RNG.normal(size=(m, rank)) @ basis.T  # rows k_i
    values = RNG.normal(size=(m, V))
    return keys, values


def _f(S, keys, values):
    r = keys @ S.T - values
    return 0.5 * float(np.mean(np.sum(r * r, axis=1)))


def _moments(keys, values):
    m = len(keys)
    return keys.T @ keys / m, values.T @ keys / m


def _f_star(keys, values):
    X, *_ = np.linalg.lstsq(keys, values, rcond=None)  # least squares over the samples, column by column
    return _f(X.T, keys, values)


@pytest.mark.parametrize("rank", [2, 4, 6], ids=["rank2", "rank4", "full"])
def test_lemma_d3_and_the_minimiser(rank):
    K, V, m = 6, 3, 12
    keys, values = _problem(K, V, m, rank)
    Sigma, C = _moments(keys, values)
    P = np.linalg.pinv(Sigma)
    L = np.linalg.eigvalsh(Sigma).max()
    f_star = _f_star(keys, values)
    for _ in range(5):
        S = RNG.normal(size=(V, K))
        g = S @ Sigma - C
        n2 = float(np.sum(g * g))
        h = lambda D: (_f(S - g @ D, keys, values) - _f(S, keys, values)) / n2  # noqa: E731
        h_star = h(P)
        assert h_star == pytest.approx(-(_f(S, keys, values) - f_star) / n2, rel=1e-8)
        assert -h_star >= 1 / (2 * L) * (1 - 1e-9)  # the Rayleigh step
        for D in (RNG.normal(size=(K, K)), np.diag(RNG.uniform(0.5, 2, size=K)), Sigma):
            assert h(D) >= h_star - 1e-12  # Σ† is the global minimiser of h


def test_theorem_d5_bound_without_monotone_updates():
    """The bound holds for arbitrary preconditioners — also steps that increase f (monotonicity unused)."""
    K, V, m, T = 4, 2, 8, 5
    keys, values = _problem(K, V, m, 3)
    Sigma, C = _moments(keys, values)
    P, L, f_star = np.linalg.pinv(Sigma), np.linalg.eigvalsh(Sigma).max(), _f_star(keys, values)
    increased = 0
    for trial in range(20):
        S = RNG.normal(size=(V, K))
        f1, regret = _f(S, keys, values), 0.0
        for _ in range(T):
            g = S @ Sigma - C
            n2 = float(np.sum(g * g))
            # a learner near the Newton comparator (the bound is then nearly tight) or a wild one
            D = P + RNG.normal(size=(K, K)) * 0.05 if trial % 2 else RNG.normal(size=(K, K)) * 2.0
            h = lambda M: (_f(S - g @ M, keys, values) - _f(S, keys, values)) / n2  # noqa: E731
            regret += h(D) - h(P)
            increased += _f(S - g @ D, keys, values) > _f(S, keys, values)
            S = S - g @ D
        assert regret >= 0
        assert _f(S, keys, values) - f_star <= (f1 - f_star) * (2 * L * regret / T) ** T * (1 + 1e-9) + 1e-12
    assert increased > 0  # some steps were not monotone


def test_exact_instances_match_numerics():
    z = theorem_d5.newton_feedback_instance(((1, 1), (2, 2)), ((1,), (3,)), ((1, 0),))
    keys, values = np.array([[1.0, 1.0], [2.0, 2.0]]), np.array([[1.0], [3.0]])
    S = np.array([[1.0, 0.0]])
    Sigma, C = _moments(keys, values)
    g = S @ Sigma - C
    h = (_f(S - g @ np.linalg.pinv(Sigma), keys, values) - _f(S, keys, values)) / float(np.sum(g * g))
    assert float(z["h_star"]) == pytest.approx(h, rel=1e-12)
    assert z["rank"] == 1 and z["L"] == 5


# --- Corollary D.8 ------------------------------------------------------------------------------------


def _stream(K, V, blocks, T, overlap=False):
    size = K // blocks
    keys = np.zeros((blocks, K))
    for c in range(blocks):
        keys[c, c * size:(c + 1) * size] = RNG.normal(size=size)
    if overlap:
        keys[0, -1] = 0.7  # class 1 now reaches into class 2's block
    values = RNG.normal(size=(blocks, V))
    classes = np.concatenate([np.arange(blocks), RNG.integers(0, blocks, size=T - blocks)])
    RNG.shuffle(classes)
    return keys, values, classes


def _run(keys, values, classes, S):
    F = lambda S, c: 0.5 * float(np.sum((S @ keys[c] - values[c]) ** 2))  # noqa: E731
    F0 = [F(S, c) for c in range(len(keys))]
    q = 1.0
    for c in classes:
        d, beta = RNG.uniform(0.5, 2.0, size=keys.shape[1]), RNG.uniform(0.05, 0.95)
        u = values[c] - S @ keys[c]
        S = S + beta * np.outer(u, d * keys[c])
        q *= (1 - beta * float(d @ (keys[c] ** 2))) ** 2
    return np.prod([F(S, c) / F0[c] for c in range(len(keys))]), q


@pytest.mark.parametrize("blocks", [2, 3, 4])
def test_corollary_d8_numerically(blocks):
    for _ in range(10):
        keys, values, classes = _stream(12, 3, blocks, 9)
        lhs, rhs = _run(keys, values, classes, RNG.normal(size=(3, 12)))
        assert lhs == pytest.approx(rhs, rel=1e-9)


def test_corollary_d8_needs_disjoint_blocks():
    misses = 0
    for _ in range(10):
        keys, values, classes = _stream(12, 3, 2, 9, overlap=True)
        lhs, rhs = _run(keys, values, classes, RNG.normal(size=(3, 12)))
        misses += not np.isclose(lhs, rhs, rtol=1e-6)
    assert misses >= 8


def test_corollary_d8_per_token_check_detects_overlap(monkeypatch):
    original = corollary_d8.block_keys

    def leaking(K):
        first, second = original(K)
        return first + sp.Matrix([0] * (K - 1) + [sp.Symbol("leak", real=True)]), second

    monkeypatch.setattr(corollary_d8, "block_keys", leaking)
    outcome = corollary_d8.check_repeated_key()
    assert outcome.status == "failed"
    assert "S'k_other = S k_other" in outcome.detail


# --- hypotheses stated ----------------------------------------------------------------------------------


def test_lemma_4_1_zero_residual_instance():
    from osdn_diag.proofs import lemma_4_1

    w = lemma_4_1.zero_residual_witness()
    S, k, v = np.array([[1.0, 2.0]]), np.array([1.0, 1.0]), np.array([3.0])
    assert np.all(v - S @ k == 0) and k @ k > 0  # u = 0 with a nonzero key
    assert w.established and w.instance["S"] == "(1, 2)"


def test_am_gm_for_every_T_is_part_of_the_d7_proof(monkeypatch):
    from osdn_diag.proofs import theorem_d7

    monkeypatch.setattr(theorem_d7, "am_gm_steps", lambda: {"AM–GM step": None})
    outcome = theorem_d7.check_proof_steps()
    assert outcome.status == "failed" and "AM–GM step" in outcome.detail


@pytest.mark.parametrize("T", [1, 3, 17, 100])
def test_am_gm_numerically(T):
    x = RNG.uniform(0, 2, size=T)
    assert np.prod(x) <= np.mean(x) ** T * (1 + 1e-12)
