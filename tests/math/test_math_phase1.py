"""OSDN phase 1 (Algorithm 1): box, emission order, the exact step, and its special cases."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from osdn_strategies import (
    KEY_KINDS,
    betas,
    cu_seqlens_of,
    dims,
    floats_in,
    keys,
    preconditioners,
    segment_lengths,
    uniform_array,
)
from torch.testing import assert_close

from osdn_diag.math import osdn_phase1, surrogate_grad

F64 = torch.float64


@st.composite
def phase1_case(draw, B=(1, 2), large=False):
    """Keyword arguments for osdn_phase1 plus the keys and β (any key kind, β ∈ (0, 1] or up to 2)."""
    D = draw(dims(B=B))
    B, T, H, K = D.B, D.T, D.H, D.K
    k = draw(keys((B, T, H, K), kinds=KEY_KINDS, scale=draw(st.sampled_from([1.0, 3.0]), label="key scale")))
    beta = draw(betas((B, T, H), hi=draw(st.sampled_from([1.0 - 1e-6, 1.0, 2.0]), label="beta max")))
    d_min = draw(floats_in(1e-3, 2.0, (1e-3, 0.5, 1.0)), label="d_min")
    d_max = draw(floats_in(d_min, 4.0, (d_min, 2.0)), label="d_max")
    eta = draw(floats_in(0.0, 1e3 if large else 1.0, (0.0, 3e-3, 1.0) + ((1e3,) if large else ())), label="eta")
    d0_options = [preconditioners((H, K), d_min, d_max), preconditioners((B, H, K), d_min, d_max)]
    if d_min <= 1.0 <= d_max:  # the default d0 = 1 is only legal inside the box
        d0_options.insert(0, st.none())
    d0 = draw(st.one_of(*d0_options), label="d0")
    retention = draw(
        st.one_of(
            st.none(),
            _unit_interval((B, T, H)),
            _unit_interval((B, T, H, K)),
        ),
        label="retention",
    )
    kw = dict(
        retention=retention,
        d0=d0,
        eta=eta,
        d_min=d_min,
        d_max=d_max,
        beta_aware=draw(st.booleans(), label="beta_aware"),
        eps=draw(st.sampled_from([1e-6, 1e-3]), label="eps"),
    )
    return k, beta, kw


def _unit_interval(shape):
    """Retention values in [0, 1], 0 and 1 included."""
    return uniform_array(shape, 0.0, 1.0, (0.0, 1.0))


def _next(res):
    """d_{t+1} for every token of an unpacked batch: the trajectory shifted by one, then d_final."""
    return torch.cat([res.d[:, 1:], res.d_final[:, None]], dim=1)


def _d0_full(d0, B, H, K):
    if d0 is None:
        return torch.ones(B, H, K, dtype=F64)
    return d0.expand(B, H, K) if d0.dim() == 2 else d0


@given(phase1_case(large=True))
def test_never_leaves_the_box(case):
    k, beta, kw = case
    res = osdn_phase1(k, beta, **kw)
    for x in (res.d, res.d_final, res.write_key):
        assert torch.isfinite(x).all()
    lo, hi = kw["d_min"], kw["d_max"]
    assert ((res.d >= lo) & (res.d <= hi)).all()
    assert ((res.d_final >= lo) & (res.d_final <= hi)).all()


@given(phase1_case())
def test_emits_write_key_before_updating(case):
    k, beta, kw = case
    B, T, H, K = k.shape
    res = osdn_phase1(k, beta, **kw)
    d0 = _d0_full(kw["d0"], B, H, K)
    assert torch.equal(res.d[:, 0], d0)
    assert torch.equal(res.write_key[:, 0], d0 * k[:, 0])
    assert torch.equal(res.write_key, res.d * k)


@given(phase1_case(large=True))
def test_each_update_is_one_projected_gradient_step_on_h(case):
    """d_{t+1} = Π_box(r_t ⊙ d_t − η ∇h_t(d_t)), with ∇h from closed_forms (β' and ε as phase 1 uses)."""
    k, beta, kw = case
    res = osdn_phase1(k, beta, **kw)
    r = kw["retention"]
    r = 1.0 if r is None else (r[..., None] if r.dim() == 3 else r)
    beta_p = beta if kw["beta_aware"] else torch.ones_like(beta)
    step = kw["eta"] * surrogate_grad(res.d, k, beta_p, eps=kw["eps"])
    expected = (r * res.d - step).clamp(kw["d_min"], kw["d_max"])
    tol = 1e-13 * (1.0 + res.d.abs().max().item() + step.abs().max().item())
    assert_close(_next(res), expected, rtol=1e-13, atol=tol)


@given(phase1_case())
def test_follows_the_algorithm_not_fig1(case):
    """Fig. 1 draws the write key with d_{t+1}; Algorithm 1 uses d_t. Wherever the step moved d on a channel
    the key touches, the two orderings give different write keys and we must give Algorithm 1's."""
    k, beta, kw = case
    res = osdn_phase1(k, beta, **kw)
    fig1 = _next(res) * k
    # "Moved" beyond rounding: a sub-ulp change of d (tiny keys under the ε floor) can vanish in d ⊙ k.
    moved = ((_next(res) - res.d).abs() > 1e-12 * res.d.abs()) & (k != 0)
    assert (res.write_key[moved] != fig1[moved]).all()
    assert torch.equal(res.write_key, res.d * k)


def test_follows_the_algorithm_not_fig1_concrete():
    k = torch.ones(1, 2, 1, 1, dtype=F64)
    beta = torch.full((1, 2, 1), 0.5, dtype=F64)
    res = osdn_phase1(k, beta, eta=0.1)
    # d_1 = 1 is used at token 1; only then d_2 = 1 + 0.1 · 0.5 · (1 − 0.5) = 1.025.
    assert res.write_key[0, 0, 0, 0].item() == 1.0
    assert res.d[0, 1, 0, 0].item() == 1.025


@given(phase1_case())
def test_retention_of_ones_is_plain_osdn(case):
    k, beta, kw = case
    B, T, H, K = k.shape
    plain = osdn_phase1(k, beta, **{**kw, "retention": None})
    for r in (torch.ones(B, T, H, dtype=F64), torch.ones(B, T, H, K, dtype=F64)):
        apf = osdn_phase1(k, beta, **{**kw, "retention": r})
        assert torch.equal(apf.d, plain.d)
        assert torch.equal(apf.write_key, plain.write_key)
        assert torch.equal(apf.d_final, plain.d_final)


@given(phase1_case())
def test_per_channel_retention_broadcast_from_scalar_equals_scalar_form(case):
    k, beta, kw = case
    B, T, H, K = k.shape
    r = torch.rand(B, T, H, dtype=F64, generator=torch.Generator().manual_seed(T * 31 + K))
    scalar = osdn_phase1(k, beta, **{**kw, "retention": r})
    channel = osdn_phase1(k, beta, **{**kw, "retention": r[..., None].expand(B, T, H, K)})
    assert torch.equal(scalar.d, channel.d)
    assert torch.equal(scalar.d_final, channel.d_final)
    assert torch.equal(scalar.write_key, channel.write_key)


@given(phase1_case())
def test_zero_step_size_freezes_d(case):
    k, beta, kw = case
    B, T, H, K = k.shape
    res = osdn_phase1(k, beta, **{**kw, "eta": 0.0, "retention": None})
    d0 = _d0_full(kw["d0"], B, H, K)
    assert torch.equal(res.d, d0[:, None].expand(B, T, H, K))
    assert torch.equal(res.d_final, d0)
    assert torch.equal(res.write_key, d0[:, None] * k)


@given(phase1_case())
def test_not_beta_aware_is_beta_aware_with_unit_beta(case):
    k, beta, kw = case
    a = osdn_phase1(k, beta, **{**kw, "beta_aware": False})
    b = osdn_phase1(k, torch.ones_like(beta), **{**kw, "beta_aware": True})
    assert torch.equal(a.d, b.d)
    assert torch.equal(a.d_final, b.d_final)
    assert torch.equal(a.write_key, b.write_key)


@given(st.data())
def test_packed_sweep_restarts_d_at_every_boundary(data):
    lens = data.draw(segment_lengths(max_len=6))
    N, T = len(lens), sum(lens)
    H, K = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 5))
    k = data.draw(keys((1, T, H, K), kinds=KEY_KINDS))
    beta = data.draw(betas((1, T, H), hi=1.0))
    lo, hi = 0.5, 2.0
    d0 = data.draw(
        st.one_of(st.none(), preconditioners((H, K), lo, hi), preconditioners((N, H, K), lo, hi)),
        label="d0",
    )
    retention = data.draw(st.one_of(st.none(), _unit_interval((1, T, H))), label="retention")
    kw = dict(eta=data.draw(floats_in(0.0, 1.0, (1.0,)), label="eta"), d_min=lo, d_max=hi,
              beta_aware=data.draw(st.booleans(), label="beta_aware"))
    cu = cu_seqlens_of(lens, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    packed = osdn_phase1(k, beta, d0=d0, retention=retention, cu_seqlens=cu, **kw)
    assert packed.d_final.shape == (N, H, K)
    offs = cu.tolist()
    for n, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        d0_n = None if d0 is None else (d0 if d0.dim() == 2 else d0[n])
        r_n = None if retention is None else retention[:, bos:eos]
        alone = osdn_phase1(k[:, bos:eos], beta[:, bos:eos], d0=d0_n, retention=r_n, **kw)
        assert_close(packed.d[:, bos:eos], alone.d, rtol=1e-15, atol=0)
        assert_close(packed.write_key[:, bos:eos], alone.write_key, rtol=1e-15, atol=0)
        assert_close(packed.d_final[n : n + 1], alone.d_final, rtol=1e-15, atol=0)
        if eos > bos:
            start = torch.ones(H, K, dtype=F64) if d0_n is None else d0_n
            assert torch.equal(packed.d[0, bos], start)
