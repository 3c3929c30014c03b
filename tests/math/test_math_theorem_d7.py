"""Theorem D.7 on real phase-1 iterates: log Π_t q_t ≤ T · log(2 ε_T(d) + 2 R_T(d) / T) for every comparator d
in the box, with q_t measured by replaying the OSDN recurrence on the phase-1 trajectory (unit keys).

With unit keys 2 ε_T(d) + 2 R_T(d) / T is the arithmetic mean of the q_t, whatever d is; the bound is then
AM–GM. Both facts are checked separately.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from osdn_strategies import (
    UNIT_KINDS,
    betas,
    dims,
    floats_in,
    keys,
    preconditioners,
    states,
    values,
)
from torch.testing import assert_close

from osdn_diag.math import (
    comparator_gap,
    log_bound,
    osdn,
    osdn_phase1,
    regret,
    residual_ratio,
    write_gain,
)

D_MIN, D_MAX = 0.5, 2.0


def _stream(data, comparator_range=(D_MIN, D_MAX)):
    D = data.draw(dims())
    B, T, H, K, V = D.B, D.T, D.H, D.K, D.V
    k = data.draw(keys((B, T, H, K), kinds=UNIT_KINDS))
    beta = data.draw(betas((B, T, H)))
    eta = data.draw(floats_in(1e-3, 1.0, (1e-3, 1.0)), label="eta")
    d0 = data.draw(st.one_of(st.none(), preconditioners((H, K), D_MIN, D_MAX)), label="d0")
    beta_aware = data.draw(st.booleans(), label="beta_aware")
    ph1 = osdn_phase1(k, beta, d0=d0, eta=eta, d_min=D_MIN, d_max=D_MAX, beta_aware=beta_aware)
    v = data.draw(values((B, T, H, V)))
    S0 = data.draw(states((B, H, V, K), allow_zero=False))
    rec = osdn(k, k, v, beta, ph1.d, initial_state=S0)
    q = residual_ratio(rec.loss_after, rec.loss_before)  # [B, T, H]
    d_cmp = data.draw(preconditioners((B, H, K), *comparator_range), label="comparator")
    # Stream layout of closed_forms: time second to last.
    k_s, beta_s, traj_s = k.transpose(1, 2), beta.transpose(1, 2), ph1.d.transpose(1, 2)
    eps_T = comparator_gap(d_cmp, k_s, beta_s)
    R_T = regret(traj_s, d_cmp, k_s, beta_s)
    a = write_gain(k, beta, ph1.d)
    return T, q.transpose(1, 2), eps_T, R_T, a.transpose(1, 2), rec


# The theorem's q_t = f_t(S_t) / f_t(S_{t−1}) needs f_t(S_{t−1}) > 0 (see the last test). Unit keys keep
# the replayed state O(1), so an absolute floor separates real residuals from rounding artefacts.
LOSS_FLOOR = 1e-12


@given(st.data())
def test_log_product_of_ratios_is_below_the_bound(data):
    T, q, eps_T, R_T, _, rec = _stream(data)
    lhs = torch.log(q).sum(-1)  # −inf as soon as one q_t is exactly 0
    rhs = log_bound(eps_T, R_T, T)
    assert not torch.isnan(rhs).any() and not torch.isnan(lhs).any()
    base = 2.0 * eps_T + 2.0 * R_T / T
    pos = base > 0
    assert_close(rhs[pos], (T * torch.log(base))[pos], rtol=1e-12, atol=0)
    assert torch.isneginf(rhs[~pos]).all()  # a base that rounds to ≤ 0 here is a true 0, not a failure
    holds = lhs <= rhs + 1e-9
    # Where the mean ratio is ~0 (a_t ≈ 1 on every token) log space magnifies rounding without bound:
    # the replayed q_t carry an absolute error ~|1 − a_t|·1e-16 and the closed-form base one of
    # ~1e-16·(ε_T + |R_T|/T) (it is a difference of O(1) terms). Judge those streams in linear space:
    # geometric mean ≤ arithmetic mean up to that absolute error.
    geo = torch.exp(lhs / T)
    linear = geo <= base + 1e-12 * (1.0 + eps_T + R_T.abs() / T)
    measurable = (rec.loss_before.transpose(1, 2) > LOSS_FLOOR).all(-1)
    assert (holds | ((base < 1e-6) & linear) | ~measurable).all(), (lhs, rhs)


@given(st.data())
def test_gap_plus_regret_is_the_mean_ratio_for_any_comparator(data):
    # Any positive comparator, not just the box: the identity does not depend on d.
    T, q, eps_T, R_T, a, rec = _stream(data, comparator_range=(1e-3, 4.0))
    base = 2.0 * eps_T + 2.0 * R_T / T
    assert_close(base, ((1.0 - a) ** 2).mean(-1), rtol=1e-10, atol=1e-12)
    # ... and the replayed ratios agree with it wherever the residual is macroscopic.
    ok = (rec.loss_before.transpose(1, 2) > LOSS_FLOOR).all(-1)
    assert_close(base[ok], q.mean(-1)[ok], rtol=1e-8, atol=1e-10)


def test_exact_zero_ratio_gives_minus_infinity_not_nan():
    """k = 1, β = 1/2, d ≡ 2 gives a_t = 1 exactly: q_t = 0 and both sides are −inf."""
    T = 3
    k = torch.ones(1, T, 1, 1, dtype=torch.float64)
    beta = torch.full((1, T, 1), 0.5, dtype=torch.float64)
    d0 = torch.full((1, 1), 2.0, dtype=torch.float64)
    ph1 = osdn_phase1(k, beta, d0=d0, eta=0.5, d_min=D_MIN, d_max=D_MAX)
    assert (ph1.d == 2.0).all()  # 1 − β⟨d, s⟩ = 0: no step
    v = torch.arange(1, T + 1, dtype=torch.float64).reshape(1, T, 1, 1)
    rec = osdn(k, k, v, beta, ph1.d)
    q = residual_ratio(rec.loss_after, rec.loss_before)
    assert (q == 0).all()
    lhs = torch.log(q).sum(1)
    eps_T = comparator_gap(ph1.d[:, 0], k.transpose(1, 2), beta.transpose(1, 2))
    R_T = regret(ph1.d.transpose(1, 2), ph1.d[:, 0], k.transpose(1, 2), beta.transpose(1, 2))
    rhs = log_bound(eps_T, R_T, T)
    assert torch.isneginf(lhs).all() and torch.isneginf(rhs).all()
    assert (lhs <= rhs).all()


def test_zero_residual_convention_is_outside_the_theorem():
    """q_t := 1 where f_t(S_{t−1}) = 0 is a reporting convention, not the theorem's q_t: a stream with a
    zero residual can exceed the bound (here T = 1, S_0 k = v, a = 1/2: q = 1 > (1 − a)² = 1/4)."""
    k = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    beta = torch.full((1, 1, 1), 0.5, dtype=torch.float64)
    d = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    v = torch.full((1, 1, 1, 1), 3.0, dtype=torch.float64)
    rec = osdn(k, k, v, beta, d, initial_state=torch.full((1, 1, 1, 1), 3.0, dtype=torch.float64))
    assert rec.loss_before.item() == 0.0
    q = residual_ratio(rec.loss_after, rec.loss_before)
    eps_T = comparator_gap(d[:, 0], k.transpose(1, 2), beta.transpose(1, 2))
    R_T = regret(d.transpose(1, 2), d[:, 0], k.transpose(1, 2), beta.transpose(1, 2))
    assert torch.log(q).sum().item() == 0.0
    assert log_bound(eps_T, R_T, 1).item() == pytest.approx(torch.log(torch.tensor(0.25)).item())


def test_log_bound_is_minus_infinity_not_nan_when_the_base_rounds_below_zero():
    """a_1 = 1 exactly (β = 1/2, d_1 = 2): the mean ratio is 0, but 2ε_T(d) + 2R_T(d)/T is a difference of
    O(1) terms and rounds to ±5.6e-17 depending on the comparator. The hypotheses hold: the answer must
    be −inf or log(tiny), never NaN."""
    k = torch.ones(1, 1, 1, dtype=torch.float64)  # [stream, T, K]
    beta = torch.full((1, 1), 0.5, dtype=torch.float64)
    traj = torch.full((1, 1, 1), 2.0, dtype=torch.float64)
    for c in torch.linspace(D_MIN, D_MAX, 151, dtype=torch.float64):
        d = c.reshape(1, 1)
        out = log_bound(comparator_gap(d, k, beta), regret(traj, d, k, beta), 1)
        assert not torch.isnan(out).any(), c
        assert (out < -30).all(), c
