"""Write-key equivalence, backward factorisation, post-gate residual, OSGDN fixed point, APF proximal form,
comparator gaps: float64 / autograd references that share no code with the proof modules."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize, minimize_scalar

from osdn_diag.proofs import comparator_gap, gated

RNG = np.random.default_rng(7)
F64 = torch.float64


def test_write_key_equivalence_with_autograd():
    for _ in range(10):
        V, K = (int(x) for x in RNG.integers(1, 7, size=2))
        S = torch.tensor(RNG.normal(size=(V, K)), dtype=F64, requires_grad=True)
        k, v = torch.tensor(RNG.normal(size=K), dtype=F64), torch.tensor(RNG.normal(size=V), dtype=F64)
        d, beta = torch.tensor(RNG.uniform(0.5, 2, size=K), dtype=F64), float(RNG.uniform(0, 1))
        (0.5 * ((S @ k - v) ** 2).sum()).backward()
        with torch.no_grad():
            preconditioned = S - beta * S.grad @ torch.diag(d)
            u, kt = v - S @ k, d * k
            torch.testing.assert_close(preconditioned, S + beta * torch.outer(u, kt), rtol=1e-12, atol=1e-12)
            eq5 = S @ (torch.eye(K, dtype=F64) - beta * torch.outer(k, kt)) + beta * torch.outer(v, kt)
            torch.testing.assert_close(preconditioned, eq5, rtol=1e-12, atol=1e-12)


def test_backward_factorisation_with_autograd():
    K = 5
    W, U = (torch.tensor(RNG.normal(size=(3, K)), dtype=F64) for _ in range(2))
    for _ in range(5):
        d = torch.tensor(RNG.uniform(0.5, 2, size=K), dtype=F64, requires_grad=True)
        k = torch.tensor(RNG.normal(size=K), dtype=F64, requires_grad=True)
        loss = lambda kt, k: (torch.sin(W @ kt) * torch.cos(U @ k)).sum() + (kt * k).sum() ** 2  # noqa: E731
        loss(d * k, k).backward()
        # the factorised form: ∂ℒ/∂k̃ at k̃ = d ⊙ k, and the direct ∂ℒ/∂k, from a separate graph
        kt_leaf = (d * k).detach().requires_grad_(True)
        k_leaf = k.detach().requires_grad_(True)
        loss(kt_leaf, k_leaf).backward()
        with torch.no_grad():
            torch.testing.assert_close(d.grad, k * kt_leaf.grad, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(k.grad, k_leaf.grad + d * kt_leaf.grad, rtol=1e-12, atol=1e-12)


def test_post_gate_residual_numerically():
    pre_gate_matches = 0
    for _ in range(20):
        V, K = 3, 6
        S, v, k = RNG.normal(size=(V, K)), RNG.normal(size=V), RNG.normal(size=K)
        d, beta, alpha = RNG.uniform(0.5, 2, size=K), RNG.uniform(0, 1), RNG.uniform(0.3, 0.99)
        a = beta * float(d @ (k * k))
        S_bar = alpha * S
        S_new = S_bar + beta * np.outer(v - S_bar @ k, d * k)
        f = lambda X: 0.5 * float(np.sum((X @ k - v) ** 2))  # noqa: E731
        assert f(S_new) / f(S_bar) == pytest.approx((1 - a) ** 2, rel=1e-10)
        pre_gate_matches += np.isclose(f(S_new) / f(S), (1 - a) ** 2, rtol=1e-6)
    assert pre_gate_matches == 0


def _iterate(beta, eta, rho, d0, k, steps, box=None):
    d, s = np.array(d0, dtype=float), k * k
    for _ in range(steps):
        d = rho * d + eta * beta * (1 - beta * float(d @ s)) / max(float(k @ k), 1e-6) * s
        if box is not None:
            d = np.clip(d, *box)
    return d


def test_osgdn_fixed_points_by_iteration():
    k = RNG.normal(size=4)
    k /= np.linalg.norm(k)
    d = _iterate(0.7, 0.5, 1.0, np.ones(4), k, 2000)
    assert 0.7 * float(d @ (k * k)) == pytest.approx(1.0, abs=1e-10)  # ρ = 1: the Newton point
    z = gated.fixed_point_retention()
    d = _iterate(0.5, 0.003, 0.999, [1.0], np.array([1.0]), 30000)
    assert d[0] == pytest.approx(float(z["d"]), rel=1e-9) and 0.5 * d[0] == pytest.approx(3 / 7, rel=1e-9)
    d = _iterate(0.25, 0.003, 1.0, [1.0], np.array([1.0]), 5000, box=(0.5, 2.0))
    assert d[0] == 2.0  # the clamp stops short of the Newton point d = 4


def test_apf_proximal_and_implicit_steps_numerically():
    K = 4
    for _ in range(5):
        k = RNG.normal(size=K)
        s, n = k * k, float(k @ k)
        d, r = RNG.uniform(0.5, 2, size=K), RNG.uniform(0.8, 1, size=K)
        beta, eta = RNG.uniform(0.1, 0.9), RNG.uniform(0.01, 0.5)
        grad = -beta * (1 - beta * float(d @ s)) / n * s
        phi = lambda D: float(grad @ D) + float(np.sum((D - r * d) ** 2)) / (2 * eta)  # noqa: E731
        best = minimize(phi, d, method="BFGS", options={"gtol": 1e-12}).x
        apf = r * d + eta * beta * (1 - beta * float(d @ s)) / max(n, 1e-6) * s  # Eq. (7), unprojected
        np.testing.assert_allclose(best, apf, rtol=1e-6, atol=1e-8)
        h = lambda D: ((1 - beta * float(D @ s)) ** 2 - 1) / (2 * n)  # noqa: E731
        implicit = minimize(lambda D: h(D) + float(np.sum((D - r * d) ** 2)) / (2 * eta), d, method="BFGS",
                            options={"gtol": 1e-12}).x
        c = eta * beta**2 / n
        rhs = r * d + eta * beta / n * s
        sherman = rhs - c * s * float(s @ rhs) / (1 + c * float(s @ s))
        np.testing.assert_allclose(implicit, sherman, rtol=1e-6, atol=1e-8)


def test_box_gap_example_numerically():
    w = comparator_gap.box_gap_example()
    h = lambda d: ((1 - 0.25 * d) ** 2 - 1) / 2  # noqa: E731
    boxed = minimize_scalar(h, bounds=(0.5, 2.0), method="bounded", options={"xatol": 1e-12}).fun
    free = minimize_scalar(h).fun
    assert float(w.lhs) == pytest.approx(boxed - free, abs=1e-8) and boxed - free > 0.1
