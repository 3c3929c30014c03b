"""The blocked phase-1 sweep (:mod:`osdn_diag.math.phase1_blocked`) equals the sequential one
(:func:`osdn_diag.math.phase1.osdn_phase1`) in fp64 — active clamps, retention 0 and 1, zero keys,
packed sequences — for every block size; its scan is the sequential composition; and it
converges in a few rounds at realistic settings."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
import pytest
from osdn_strategies import cu_seqlens_of, segment_lengths, uniform_array
from test_math_phase1 import phase1_case
from torch.testing import assert_close

from osdn_diag.math import osdn_phase1
from osdn_diag.math.phase1_blocked import BlockedStats, clamped_affine_scan, osdn_phase1_blocked

TOL = dict(rtol=1e-9, atol=1e-10)


@given(phase1_case(), st.sampled_from([1, 2, 3, 5, 8, 64]), st.booleans())
def test_equals_the_sequential_sweep(case, block, no_box):
    """η ≤ 1 (β up to 2): beyond that the sweep overshoots and amplifies rounding by up to η per
    token, so two exact algorithms that round differently part ways — the sweep itself is then
    ill-conditioned, not either implementation wrong."""
    k, beta, kw = case
    if no_box:
        kw = dict(kw, d_min=None, d_max=None, eta=min(kw["eta"], 1.0))  # unbounded d: keep η sane
    ref = osdn_phase1(k, beta, **kw)
    got = osdn_phase1_blocked(k, beta, **kw, block=block)
    assert_close(got.d, ref.d, **TOL)
    assert_close(got.d_final, ref.d_final, **TOL)
    assert_close(got.write_key, ref.write_key, **TOL)


@given(st.data())
def test_packed_sequences_equal_the_sequential_sweep(data):
    lengths = data.draw(segment_lengths(), label="lengths")
    cu = cu_seqlens_of(lengths)
    k, beta, kw = data.draw(phase1_case(B=(1, 1)), label="case")
    T = int(cu[-1])
    k, beta = _fit(k, T), _fit(beta, T)
    if kw["retention"] is not None:
        kw["retention"] = _fit(kw["retention"], T)
    if kw["d0"] is not None and kw["d0"].dim() == 3:
        kw["d0"] = kw["d0"][:1].expand(len(lengths), *kw["d0"].shape[1:]).contiguous()
    ref = osdn_phase1(k, beta, **kw, cu_seqlens=cu)
    got = osdn_phase1_blocked(k, beta, **kw, cu_seqlens=cu, block=4)
    assert_close(got.d, ref.d, **TOL)
    assert_close(got.d_final, ref.d_final, **TOL)


def _fit(x, T):
    """Repeat or cut ``x`` along time to length ``T`` (the drawn case and the drawn lengths differ)."""
    reps = -(-T // x.shape[1])
    return x.repeat(1, reps, *([1] * (x.dim() - 2)))[:, :T].contiguous()


@pytest.mark.parametrize("retention", [None, 0.98], ids=["osdn", "apf-like"])
def test_few_picard_rounds_at_realistic_settings(retention):
    """η = 0.5, K = 64, β ∈ (0, 1): the coupling between tokens is weak, so a block of 32 converges in
    a handful of rounds — with d bouncing on and off the box (APF-like retention pins most of it at
    d_min, and keys with a large coordinate keep pushing single coordinates back up) or not."""
    g = torch.Generator().manual_seed(0)
    T, K = 1024, 64
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, K, generator=g, dtype=torch.float64), dim=-1)
    beta = torch.rand(1, T, 1, generator=g, dtype=torch.float64)
    r = None if retention is None else torch.full((1, T, 1), retention, dtype=torch.float64)
    stats = BlockedStats()
    got = osdn_phase1_blocked(k, beta, retention=r, eta=0.5, block=32, stats=stats)
    ref = osdn_phase1(k, beta, retention=r, eta=0.5)
    assert_close(got.d, ref.d, **TOL)
    if retention is not None:
        assert float((ref.d == 0.5).double().mean()) > 0.5  # the regime: the clamp is busy
    assert stats.blocks == T // 32
    assert stats.max_rounds <= 12, stats  # fp64: converged to 8 ulp


def test_one_round_per_block_in_fp32_at_the_papers_setting():
    """K = 128, η = 0.003: inside a block d moves by ~1e-5, so the first guess (d frozen at the
    block's start) is already the fixed point in fp32 — a blocked kernel does one scan per block."""
    g = torch.Generator().manual_seed(1)
    T, K = 1024, 128
    k = torch.nn.functional.normalize(torch.randn(2, T, 2, K, generator=g, dtype=torch.float64), dim=-1)
    beta = torch.rand(2, T, 2, generator=g, dtype=torch.float64)
    stats = BlockedStats()
    got = osdn_phase1_blocked(k.float(), beta.float(), eta=0.003, block=64, stats=stats)
    ref = osdn_phase1(k, beta, eta=0.003)
    assert stats.max_rounds == 1, stats
    assert float((got.d.double() - ref.d).norm() / ref.d.norm()) <= 1e-6


@given(st.data())
def test_clamped_affine_scan_is_the_sequential_composition(data):
    n = data.draw(st.integers(1, 17), label="n")
    K = data.draw(st.integers(1, 4), label="K")
    a = data.draw(uniform_array((n, K), 0.0, 2.0, (0.0, 1.0)), label="a")
    b = data.draw(uniform_array((n, K), -2.0, 2.0, (0.0,)), label="b")
    lo = data.draw(uniform_array((n, K), -1.0, 1.0, (-1.0,)), label="lo")
    width = data.draw(uniform_array((n, K), 0.0, 2.0, (0.0,)), label="width")
    hi = lo + width
    if data.draw(st.booleans(), label="no box"):
        lo, hi = torch.full_like(lo, -torch.inf), torch.full_like(hi, torch.inf)
    x = data.draw(uniform_array((K,), -3.0, 3.0), label="x0")
    want = [x]
    for t in range(n):
        want.append(torch.minimum(torch.maximum(a[t] * want[-1] + b[t], lo[t]), hi[t]))
    assert_close(clamped_affine_scan(a, b, lo, hi, x), torch.stack(want), rtol=1e-12, atol=1e-12)


def test_block_must_be_a_positive_integer():
    k = torch.nn.functional.normalize(torch.randn(1, 4, 1, 3, dtype=torch.float64), dim=-1)
    with pytest.raises(ValueError, match="block"):
        osdn_phase1_blocked(k, torch.rand(1, 4, 1, dtype=torch.float64), block=0)
