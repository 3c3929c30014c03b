"""Equalities across the recurrence family, and the gated write's post-decay residual (App. B.1)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from osdn_strategies import (
    GATED,
    prefix_states,
    run_wrapper,
    states,
    well_posed,
    wrapper_decay,
    wrapper_inputs,
    wrapper_write_key,
)
from torch.testing import assert_close

from osdn_diag.math import (
    deltanet,
    gated_deltanet,
    kda,
    osdn,
    osgdn,
    oskda,
    residual_ratio,
    write_gain,
)

FIELDS = ("o", "final_state", "loss_before", "loss_after", "write_gain")


def _same(a, b, fields=FIELDS, transpose_state=False):
    for f in fields:
        x, y = getattr(a, f), getattr(b, f)
        if f == "final_state" and transpose_state:
            y = y.transpose(-1, -2)
        assert x.shape == y.shape, f
        assert_close(x, y, rtol=1e-14, atol=1e-14 * (1.0 + y.abs().max().item()) if y.numel() else 0.0, msg=f)


@st.composite
def problem(draw):
    inp, D = draw(wrapper_inputs())
    S0 = draw(st.one_of(st.none(), states((D.B, D.H, D.V, D.K))), label="initial_state")
    return inp, S0


@given(problem())
def test_deltanet_is_osdn_with_unit_preconditioner(case):
    x, S0 = case
    a = deltanet(x["q"], x["k"], x["v"], x["beta"], initial_state=S0)
    b = osdn(x["q"], x["k"], x["v"], x["beta"], torch.ones_like(x["k"]), initial_state=S0)
    _same(a, b)
    assert a.loss_before_decayed is None and b.loss_before_decayed is None


@given(problem())
def test_gated_deltanet_without_decay_is_deltanet(case):
    x, S0 = case
    zero = torch.zeros_like(x["beta"])
    a = gated_deltanet(x["q"], x["k"], x["v"], x["beta"], zero, initial_state=S0)
    b = deltanet(x["q"], x["k"], x["v"], x["beta"], initial_state=S0)
    _same(a, b)
    assert_close(a.loss_before_decayed, a.loss_before, rtol=1e-14, atol=0)


@given(problem())
def test_osgdn_without_decay_is_osdn(case):
    x, S0 = case
    zero = torch.zeros_like(x["beta"])
    a = osgdn(x["q"], x["k"], x["v"], x["beta"], zero, x["d"], initial_state=S0)
    b = osdn(x["q"], x["k"], x["v"], x["beta"], x["d"], initial_state=S0)
    _same(a, b)
    assert_close(a.loss_before_decayed, a.loss_before, rtol=1e-14, atol=0)


@given(problem())
def test_kda_without_decay_is_deltanet_in_transposed_layout(case):
    x, S0 = case
    zero = torch.zeros_like(x["k"])
    S0_kv = None if S0 is None else S0.transpose(-1, -2)  # KDA's native K×V
    a = kda(x["q"], x["k"], x["v"], x["beta"], zero, initial_state=S0_kv)
    b = deltanet(x["q"], x["k"], x["v"], x["beta"], initial_state=S0)
    B, T, H, K = x["k"].shape
    assert a.final_state.shape == (B, H, K, x["v"].shape[-1])
    _same(a, b, transpose_state=True)


@given(problem())
def test_oskda_with_channel_constant_gate_is_osgdn(case):
    x, S0 = case
    K = x["k"].shape[-1]
    g = x["g_scalar"]
    S0_kv = None if S0 is None else S0.transpose(-1, -2)
    a = oskda(x["q"], x["k"], x["v"], x["beta"], g[..., None].expand(*g.shape, K), x["d"], initial_state=S0_kv)
    b = osgdn(x["q"], x["k"], x["v"], x["beta"], g, x["d"], initial_state=S0)
    _same(a, b, fields=(*FIELDS, "loss_before_decayed"), transpose_state=True)


@pytest.mark.parametrize("name", GATED)
@given(data=st.data())
def test_gated_write_uses_the_post_decay_residual(name, data):
    """S_t = S̄_{t−1} + β_t u_t k̃_tᵀ with u_t = v_t − S̄_{t−1} k_t; f_t(S̄_{t−1}) = ½‖u_t‖²; and the post-gate
    ratio f_t(S_t) / f_t(S̄_{t−1}) is exactly Lemma 4.1's (1 − a_t)²."""
    x, D = data.draw(wrapper_inputs(T=(1, 8)))
    S0 = data.draw(states((D.B, D.H, D.V, D.K)), label="initial_state")
    res = run_wrapper(name, **x, initial_state=S0)
    T = D.T

    def prefix(t):
        sl = {n: (val[:, :t] if torch.is_tensor(val) else val) for n, val in x.items()}
        return run_wrapper(name, **sl, initial_state=S0).final_state

    S = prefix_states(prefix, T)
    alpha = wrapper_decay(name, x["g_scalar"], x["g_channel"])
    wk = wrapper_write_key(name, x["k"], x["d"], x["write_key"])
    k, v, beta = x["k"], x["v"], x["beta"]
    for t in range(T):
        S_bar = S[t] * alpha[:, t]
        u = v[:, t] - torch.einsum("bhvk,bhk->bhv", S_bar, k[:, t])
        err = torch.einsum("bhvk,bhk->bhv", S[t], k[:, t]) - v[:, t]
        scale = 1.0 + S[t].abs().max().item() + v.abs().max().item()
        assert_close(res.loss_before[:, t], 0.5 * err.square().sum(-1), rtol=1e-12, atol=1e-14 * scale**2)
        assert_close(res.loss_before_decayed[:, t], 0.5 * u.square().sum(-1), rtol=1e-12, atol=1e-14 * scale**2)
        expected = S_bar + beta[:, t, :, None, None] * u[..., :, None] * wk[:, t, :, None, :]
        assert_close(S[t + 1], expected, rtol=1e-12, atol=1e-13 * scale)

    a = write_gain(k, beta, None) if wk is k else beta * (wk * k).sum(-1)
    assert_close(res.write_gain, a, rtol=1e-13, atol=1e-300)
    S_prev = torch.stack(S[:-1], dim=1)
    S_bar = S_prev * alpha
    size = v.norm(dim=-1) + S_bar.flatten(-2).norm(dim=-1) * k.norm(dim=-1)
    ok = well_posed(res.loss_before_decayed, size)
    q_post = residual_ratio(res.loss_after, res.loss_before_decayed)
    assert_close(q_post[ok], ((1.0 - a) ** 2)[ok], rtol=1e-9, atol=1e-12)
