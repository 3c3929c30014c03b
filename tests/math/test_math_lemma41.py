"""Lemma 4.1: one OSDN write scales the token-local loss by exactly (1 − a_t)², for any key k_t ≠ 0.

The ratio is *replayed* (measured from the recurrence's states), never computed from the identity.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from osdn_strategies import (
    KEY_KINDS,
    UNIT_KINDS,
    betas,
    dims,
    gaussians,
    keys,
    preconditioners,
    prefix_states,
    states,
    values,
    well_posed,
)
from torch.testing import assert_close

from osdn_diag.math import osdn, residual_ratio, surrogate, write_gain


def _draw_problem(data, kinds=KEY_KINDS):
    D = data.draw(dims())
    B, T, H, K, V = D.B, D.T, D.H, D.K, D.V
    k = data.draw(keys((B, T, H, K), kinds=kinds))
    beta = data.draw(betas((B, T, H)))
    d = data.draw(preconditioners((B, T, H, K), 1e-3, 4.0))  # arbitrary positive d, not boxed
    v = data.draw(values((B, T, H, V)))
    S0 = data.draw(states((B, H, V, K), allow_zero=False))
    q = data.draw(gaussians((B, T, H, K)))
    res = osdn(q, k, v, beta, d, initial_state=S0)
    # S_{t-1} for every token, read off the library's own recurrence on the prefixes.
    S = prefix_states(
        lambda t: osdn(q[:, :t], k[:, :t], v[:, :t], beta[:, :t], d[:, :t], initial_state=S0).final_state,
        T,
    )
    S_prev = torch.stack(S[:-1], dim=1)  # [B, T, H, V, K]
    scale = v.norm(dim=-1) + S_prev.flatten(-2).norm(dim=-1) * k.norm(dim=-1)
    return k, beta, d, res, scale


@given(st.data())
def test_replayed_ratio_is_one_minus_gain_squared(data):
    k, beta, d, res, scale = _draw_problem(data)
    a = write_gain(k, beta, d)
    assert_close(res.write_gain, a, rtol=1e-13, atol=1e-300)
    ratio = residual_ratio(res.loss_after, res.loss_before)
    ok = well_posed(res.loss_before, scale)
    assert_close(ratio[ok], ((1.0 - a) ** 2)[ok], rtol=1e-9, atol=1e-12)


@given(st.data())
def test_ratio_is_one_plus_2_n_h_for_any_nonzero_key(data):
    k, beta, d, res, scale = _draw_problem(data)
    n = (k * k).sum(-1)
    ok = well_posed(res.loss_before, scale) & (n > 0)
    ratio = residual_ratio(res.loss_after, res.loss_before)
    h = surrogate(d, k, beta)
    assert_close(ratio[ok], (1.0 + 2.0 * n * h)[ok], rtol=1e-9, atol=1e-12)


@given(st.data())
def test_ratio_is_one_plus_2h_for_unit_keys(data):
    k, beta, d, res, scale = _draw_problem(data, kinds=UNIT_KINDS)
    ok = well_posed(res.loss_before, scale)
    ratio = residual_ratio(res.loss_after, res.loss_before)
    assert_close(ratio[ok], (1.0 + 2.0 * surrogate(d, k, beta))[ok], rtol=1e-9, atol=1e-12)


def test_one_plus_2h_needs_unit_keys():
    """With ‖k‖² = n ≠ 1 the unit-key relation is off by (1/n − 1)((1 − a)² − 1): it must not hold."""
    k = torch.tensor([[[[2.0, 0.0]]]], dtype=torch.float64)  # n = 4
    beta = torch.tensor([[[0.5]]], dtype=torch.float64)
    d = torch.tensor([[[[0.25, 1.0]]]], dtype=torch.float64)  # a = 0.5 * 0.25 * 4 = 0.5
    v = torch.tensor([[[[1.0]]]], dtype=torch.float64)
    res = osdn(k, k, v, beta, d)
    ratio = residual_ratio(res.loss_after, res.loss_before)
    assert_close(ratio, torch.full_like(ratio, 0.25), rtol=1e-15, atol=0)
    h = surrogate(d, k, beta)
    assert_close(1.0 + 2.0 * 4.0 * h, ratio, rtol=1e-15, atol=0)
    assert not torch.allclose(1.0 + 2.0 * h, ratio)
