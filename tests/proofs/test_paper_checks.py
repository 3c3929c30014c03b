"""Zero-residual conventions and repairs, Newton feasibility, and the paper's internal inconsistencies,
against float64 references and the package's own phase 1 (which the ledger says follows Listing 1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from osdn_diag.math.phase1 import osdn_phase1
from osdn_diag.proofs import inconsistencies, newton_feasibility, zero_residual

RNG = np.random.default_rng(11)


def _stream(T, K, zero_every=3):
    """A unit-key stream from S = 0 whose every ``zero_every``-th token repeats the previous token's
    key and asks for the value the state now returns there (so its residual is exactly 0)."""
    keys, values, betas, traj = [], [], [], []
    S = np.zeros((2, K))
    for t in range(T):
        if t % zero_every == zero_every - 1:
            k = keys[-1]
            v = S @ k
        else:
            k = RNG.normal(size=K)
            k /= np.linalg.norm(k)
            v = RNG.normal(size=2)
        beta, d = RNG.uniform(0.2, 0.9), RNG.uniform(0.5, 2.0, size=K)
        keys.append(k), values.append(v), betas.append(beta), traj.append(d)
        S = S + beta * np.outer(v - S @ k, d * k)
    return np.array(keys), np.array(values), np.array(betas), np.array(traj)


def _quantities(keys, values, betas, traj, comparator):
    S = np.zeros((2, keys.shape[1]))
    rows = []
    for k, v, beta, d in zip(keys, values, betas, traj):
        u = v - S @ k
        s = k * k
        a, a_star = beta * float(d @ s), beta * float(comparator @ s)
        h, h_star = ((1 - a) ** 2 - 1) / 2, ((1 - a_star) ** 2 - 1) / 2
        rows.append((float(u @ u), (1 - a) ** 2, h, h_star, (1 - a_star) ** 2))
        S = S + beta * np.outer(u, d * k)
    return rows


def _bound(rows):
    T = len(rows)
    eps = sum(r[4] for r in rows) / (2 * T)
    regret = sum(r[2] - r[3] for r in rows)
    return (2 * eps + 2 * regret / T) ** T


def test_zero_residual_repairs_numerically():
    K = 4
    for _ in range(10):
        keys, values, betas, traj = _stream(9, K)
        comparator = RNG.uniform(0.5, 2.0, size=K)
        rows = _quantities(keys, values, betas, traj, comparator)
        zero = [r for r in rows if r[0] < 1e-20]
        kept = [r for r in rows if r[0] >= 1e-20]
        assert len(zero) == 3
        assert np.prod([r[1] for r in kept]) <= _bound(kept) * (1 + 1e-9)  # repair 1: drop
        assert np.prod([r[1] for r in rows]) <= _bound(rows) * (1 + 1e-9)  # repair 2: continuous
        mean_q = np.mean([r[1] for r in rows])
        assert mean_q == pytest.approx(_bound(rows) ** (1 / len(rows)), rel=1e-9)  # the identity behind it


def test_exact_streams_of_the_repairs():
    mixed = zero_residual.mixed_stream()
    assert mixed["kept"] == 2 and mixed["T"] == 4
    assert mixed["prod_convention"] > mixed["bound_convention"]  # the paper's convention fails here too
    assert mixed["prod_drop"] <= mixed["bound_drop"] and mixed["prod_continuous"] <= mixed["bound_continuous"]


def test_newton_system_is_overdetermined_beyond_K():
    K = 6
    for _ in range(10):
        k = RNG.normal(size=(K + 1, K))
        k /= np.linalg.norm(k, axis=1, keepdims=True)
        A = RNG.uniform(0.6, 0.99, size=(K + 1, 1)) * k * k
        residual = lambda M: np.linalg.norm(M @ np.linalg.lstsq(M, np.ones(len(M)), rcond=None)[0] - 1)  # noqa: E731
        assert residual(A) > 1e-6  # T = K + 1: no exact solution
        assert residual(A[:K]) < 1e-10  # T = K: solvable
        assert abs(np.linalg.det(np.hstack([A, np.ones((K + 1, 1))]))) > 1e-12
    z = newton_feasibility.supporting_sweep()
    assert z["eps_T16"] < 1e-20 < 1e-4 < z["eps_T32"]


def test_package_phase1_follows_listing_1_not_app_b():
    """beta_aware=False with a non-unit key: osdn-diag divides by max(‖k‖², ε), as Listing 1 does."""
    k = torch.tensor([[[[1.0, 1.0]]]], dtype=torch.float64)  # ‖k‖² = 2
    beta = torch.tensor([[[0.5]]], dtype=torch.float64)
    d0 = torch.full((1, 2), 0.25, dtype=torch.float64)
    res = osdn_phase1(k, beta, d0=d0, eta=0.003, d_min=None, d_max=None, beta_aware=False)
    got = res.d_final[0, 0, 0].item()
    import sympy as sp

    listing = inconsistencies.listing_1_step(sp.Matrix([0.25, 0.25]), sp.Matrix([1, 1]), sp.Rational(3, 1000), 1)
    app_b = inconsistencies.app_b_step(sp.Matrix([0.25, 0.25]), sp.Matrix([1, 1]), sp.Rational(3, 1000), 1)
    assert got == pytest.approx(float(listing[0]), rel=1e-14)
    assert got != pytest.approx(float(app_b[0]), rel=1e-6)


def test_fig1_witness_numbers():
    w = inconsistencies.check_fig1()
    assert w.status == "verified"
    # Algorithm 1 writes with d_1 = 1; Fig. 1's order would use d_2 = 1 + 0.1 · 0.5 · (1 − 0.5) = 1.025
    assert "41/40" in w.detail
