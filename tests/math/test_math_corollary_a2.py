"""Corollary A.2: with unit keys, β_t ∈ (0, 1) and d_t in a box inside (0, 2], every write has gain
0 < a_t < 2 and so contracts the residual (q_t < 1). Outside those hypotheses it can fail, and a search
finds the failure."""

from __future__ import annotations

import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st
from osdn_strategies import (
    UNIT_KINDS,
    betas,
    dims,
    floats_in,
    keys,
    preconditioners,
    prefix_states,
    states,
    values,
    well_posed,
)

from osdn_diag.math import osdn, residual_ratio, write_gain


def _measured_ratio(k, beta, d, v, S0):
    """Replay OSDN and return (q_t, mask of tokens whose residual is not a rounding artefact)."""
    res = osdn(k, k, v, beta, d, initial_state=S0)
    T = k.shape[1]
    S = prefix_states(
        lambda t: osdn(k[:, :t], k[:, :t], v[:, :t], beta[:, :t], d[:, :t], initial_state=S0).final_state,
        T,
    )
    S_prev = torch.stack(S[:-1], dim=1)
    scale = v.norm(dim=-1) + S_prev.flatten(-2).norm(dim=-1) * k.norm(dim=-1)
    return residual_ratio(res.loss_after, res.loss_before), well_posed(res.loss_before, scale)


@given(st.data())
def test_inside_hypotheses_every_write_contracts(data):
    D = data.draw(dims())
    B, T, H, K, V = D.B, D.T, D.H, D.K, D.V
    k = data.draw(keys((B, T, H, K), kinds=UNIT_KINDS))
    beta = data.draw(betas((B, T, H)))  # (0, 1), including 1e-6 and 1 − 1e-6
    lo = data.draw(floats_in(1e-3, 2.0, (1e-3, 2.0)), label="d_min")
    hi = data.draw(floats_in(lo, 2.0, (lo, 2.0)), label="d_max")
    d = data.draw(preconditioners((B, T, H, K), lo, hi))
    v = data.draw(values((B, T, H, V)))
    S0 = data.draw(states((B, H, V, K), allow_zero=False))

    a = write_gain(k, beta, d)
    assert (a > 0).all() and (a < 2).all(), a
    q, ok = _measured_ratio(k, beta, d, v, S0)
    assert (q[ok] < 1).all(), (q, a)


def _single_write(beta_range, d_range):
    """One token on a random state: (beta, d, k, v, S0) with unit keys; ranges are (lo, hi) for β and d."""

    @st.composite
    def case(draw):
        K, V = draw(st.integers(1, 4)), draw(st.integers(1, 3))
        k = draw(keys((1, 1, 1, K), kinds=UNIT_KINDS))
        beta = draw(betas((1, 1, 1), *beta_range))
        d = draw(preconditioners((1, 1, 1, K), *d_range))
        v = draw(values((1, 1, 1, V)))
        S0 = draw(states((1, 1, V, K), allow_zero=False))
        return beta, d, k, v, S0

    return case()


def _fails_to_contract(case):
    beta, d, k, v, S0 = case
    q, ok = _measured_ratio(k, beta, d, v, S0)
    return bool(ok.all()) and bool((q >= 1).all())


SEARCH = settings(max_examples=2000, deadline=None, database=None)


def test_search_finds_a_counter_case_when_d_max_exceeds_2():
    cases = _single_write((1e-6, 1 - 1e-6), (0.5, 4.0))
    beta, d, k, v, S0 = find(cases, _fails_to_contract, settings=SEARCH)
    assert (beta < 1).all()
    assert ((d > 2) & (k != 0)).any()  # the only hypothesis broken is the box
    assert (write_gain(k, beta, d) >= 2).all()


def test_search_finds_a_counter_case_when_beta_exceeds_1():
    # fla's allow_neg_eigval doubles β into (0, 2).
    cases = _single_write((1 + 1e-6, 2.0 - 1e-12), (0.5, 2.0))
    beta, d, k, v, S0 = find(cases, _fails_to_contract, settings=SEARCH)
    assert (d <= 2).all()
    assert (beta > 1).all()
    assert (write_gain(k, beta, d) >= 2).all()
