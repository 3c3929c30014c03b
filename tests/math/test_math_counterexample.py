"""The ±1 counterexample: exact writes (q_t = 0 on every token) with a state that never settles.

K = V = 1, k_t = 1, v_t = (−1)^t, β_t = 1, d_t = 1: each write makes S_t k_t = v_t exactly, so the
token-local loss after the write is 0 every time — yet S_t = (−1)^t alternates forever and never
approaches 0 (or anything). Per-token contraction says nothing about convergence of the state.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from osdn_strategies import floats_in

from osdn_diag.math import deltanet, osdn, osdn_phase1, residual_ratio


def _inputs(T: int):
    t = torch.arange(1, T + 1, dtype=torch.float64)
    k = torch.ones(1, T, 1, 1, dtype=torch.float64)
    v = ((-1.0) ** t).reshape(1, T, 1, 1)
    beta = torch.ones(1, T, 1, dtype=torch.float64)
    return k, v, beta, ((-1.0) ** t)


@given(T=st.integers(1, 64), eta=floats_in(0.0, 1.0, (0.0, 1.0)))
def test_plus_minus_one_counterexample(T, eta):
    k, v, beta, expected = _inputs(T)
    # Phase 1 keeps d ≡ 1 here whatever η is: 1 − β⟨d, s⟩ = 0 on every token.
    d = osdn_phase1(k, beta, eta=eta).d
    assert (d == 1.0).all()
    for res in (osdn(k, k, v, beta, d, scale=1.0), deltanet(k, k, v, beta, scale=1.0)):
        assert (res.loss_after == 0).all()
        assert (res.write_gain == 1).all()
        # With q = k = 1 and scale 1 the read-out is the state itself: S_t = (−1)^t, exactly.
        S = res.o.reshape(T)
        assert torch.equal(S, expected)
        assert (S.abs() == 1).all()  # never approaches 0
        assert (S[1:] == -S[:-1]).all()  # alternates
        assert res.final_state.item() == expected[-1].item()
        # Every write is "perfect" (q_t = 0 after the first token, whose residual is v_1 = −1 too).
        q = residual_ratio(res.loss_after, res.loss_before)
        assert (q == 0).all()
        if T >= 2:
            assert (res.loss_before[:, 1:] == 2.0).all()  # ½ (±1 ∓ 1)² : the state is always wrong by 2
