"""Closed forms of the surrogate h (Eq. 18): gradient, Hessian, and its meaning as a normalised loss change."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from osdn_strategies import (
    NONZERO_KINDS,
    UNIT_KINDS,
    betas,
    gaussians,
    keys,
    preconditioners,
)
from torch.testing import assert_close

from osdn_diag.math import surrogate, surrogate_grad, surrogate_hessian, write_gain
from osdn_diag.math.closed_forms import log_bound

N_TOKENS = st.integers(1, 12)
K_DIM = st.integers(1, 5)


@st.composite
def token_batch(draw, kinds=NONZERO_KINDS, beta_hi=2.0):
    """``(d, k, beta, eps)`` for N independent tokens; zero keys only together with an ε floor."""
    N, K = draw(N_TOKENS), draw(K_DIM)
    eps = draw(st.sampled_from([0.0, 1e-6, 1e-3]))
    if eps > 0:
        kinds = (*kinds, "zero")
    k = draw(keys((N, K), kinds=kinds))
    beta = draw(betas((N,), hi=beta_hi))
    d = draw(preconditioners((N, K), 1e-3, 4.0))
    return d, k, beta, eps


@given(token_batch())
def test_surrogate_grad_is_the_autograd_gradient(case):
    d, k, beta, eps = case
    dd = d.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(surrogate(dd, k, beta, eps=eps).sum(), dd)
    ours = surrogate_grad(d, k, beta, eps=eps)
    assert torch.isfinite(ours).all()
    assert_close(ours, g, rtol=1e-12, atol=1e-12 * (1.0 + g.abs().max().item()))


@given(token_batch())
def test_surrogate_hessian_is_the_autograd_hessian(case):
    d, k, beta, eps = case
    hess = surrogate_hessian(k, beta, eps=eps)
    assert hess.shape == (*k.shape, k.shape[-1])
    for i in range(k.shape[0]):
        ref = torch.autograd.functional.hessian(
            lambda x, i=i: surrogate(x, k[i], beta[i], eps=eps), d[i]
        )
        assert_close(hess[i], ref, rtol=1e-12, atol=1e-12 * (1.0 + ref.abs().max().item()))


@given(token_batch())
def test_surrogate_hessian_is_psd_and_rank_at_most_one(case):
    _, k, beta, eps = case
    hess = surrogate_hessian(k, beta, eps=eps)
    assert_close(hess, hess.transpose(-1, -2), rtol=1e-15, atol=0)
    eig = torch.linalg.eigvalsh(hess)  # ascending
    top = eig[..., -1]
    assert (top >= 0).all()
    # PSD: no eigenvalue below −(rounding); rank ≤ 1: every eigenvalue but the top one is ≈ 0.
    tol = 1e-12 * top.clamp_min(1e-300)
    assert (eig[..., :-1].abs() <= tol[..., None]).all(), eig


@given(token_batch(kinds=UNIT_KINDS, beta_hi=1.0))
def test_surrogate_hessian_spectral_norm_at_most_beta_squared_for_unit_keys(case):
    _, k, beta, eps = case
    if eps > 0:  # unit keys only here: the floor must not matter
        k = torch.where((k == 0).all(-1, keepdim=True), torch.ones_like(k) / k.shape[-1] ** 0.5, k)
    norm = torch.linalg.matrix_norm(surrogate_hessian(k, beta, eps=eps), ord=2)
    assert (norm <= beta**2 * (1 + 1e-12)).all()
    assert (norm <= 1.0 + 1e-12).all()


@given(st.data())
def test_surrogate_is_normalised_loss_change_of_one_write(data):
    """h(d) = (f(S_t(d)) − f(S_{t−1})) / ‖∇f(S_{t−1})‖²_F for one explicit write S_t = S + β u (d⊙k)ᵀ."""
    N, K, V = data.draw(N_TOKENS), data.draw(K_DIM), data.draw(st.integers(1, 4))
    k = data.draw(keys((N, K), kinds=("random", "unit", "onehot")))
    beta = data.draw(betas((N,), hi=2.0))
    d = data.draw(preconditioners((N, K), 1e-3, 4.0))
    S = data.draw(gaussians((N, V, K), salt=3))
    v = data.draw(gaussians((N, V), salt=2))

    def f(M):
        return 0.5 * (torch.einsum("nvk,nk->nv", M, k) - v).square().sum(-1)

    u = v - torch.einsum("nvk,nk->nv", S, k)
    S_new = S + beta[:, None, None] * u[:, :, None] * (d * k)[:, None, :]
    grad_f = -u[:, :, None] * k[:, None, :]  # ∇_S f at S = (S k − v) kᵀ
    g2 = grad_f.square().sum((-1, -2))
    f0, f1 = f(S), f(S_new)
    h = surrogate(d, k, beta)
    # Compare numerators; the tolerance is in the units of the losses that cancel in f1 − f0.
    scale = (v.norm(dim=-1) + torch.linalg.matrix_norm(S) * k.norm(dim=-1)) ** 2
    scale = scale * (1.0 + write_gain(k, beta, d).abs()) ** 2
    err = ((f1 - f0) - h * g2).abs()
    assert (err <= 1e-9 * (f1 - f0).abs() + 1e-13 * scale).all()
    ok = (f1 - f0).abs() > 1e-4 * scale  # no catastrophic cancellation: compare the ratio itself
    assert_close(((f1 - f0) / g2)[ok], h[ok], rtol=1e-8, atol=0)



def test_log_bound_values_and_its_failed_hypotheses():
    """Theorem D.7's right-hand side T·log(2ε_T + 2R_T/T): the logarithm where the base is positive,
    −inf where it is 0 or a rounding of 0, NaN where it is negative beyond rounding — the hypotheses
    failed, which must not read as the strongest possible bound (−inf)."""
    f64 = lambda *x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    eps = f64(0.1, 0.0, 0.1, 0.1, 0.1)
    reg = f64(0.3, 0.0, -1.0, -0.2 * (1 + 1e-15), -0.2 - 1e-6)
    out = log_bound(eps, reg, 2).tolist()
    assert out[0] == pytest.approx(2 * math.log(0.5), rel=1e-15)  # base 0.2 + 0.3
    assert out[1] == -math.inf                                      # base exactly 0
    assert math.isnan(out[2])                                       # base −0.8
    assert out[3] == -math.inf                                      # base −2e-16: a rounded 0
    assert math.isnan(out[4])                                       # base −1e-6
