"""The chunkwise WY form equals the token recurrence (outputs and final state), for every chunk size."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from osdn_strategies import (
    KEY_KINDS,
    betas,
    dims,
    gaussians,
    keys,
    log_decays,
    preconditioners,
    states,
    values,
)
from torch.testing import assert_close

from osdn_diag.math import chunk_delta_rule, delta_rule_recurrence


@given(st.data())
def test_chunk_form_equals_token_recurrence(data):
    D = data.draw(dims())
    B, T, H, K, V = D.B, D.T, D.H, D.K, D.V
    k = data.draw(keys((B, T, H, K), kinds=KEY_KINDS, scale=K**-0.5))
    q = data.draw(gaussians((B, T, H, K)))
    v = data.draw(values((B, T, H, V), zero_tokens=True))
    beta = data.draw(betas((B, T, H)))
    wk_kind = data.draw(st.sampled_from(["none", "precond", "free"]), label="write_key")
    if wk_kind == "none":
        write_key = None
    elif wk_kind == "precond":
        write_key = data.draw(preconditioners((B, T, H, K), 0.5, 2.0)) * k
    else:
        write_key = data.draw(keys((B, T, H, K), kinds=KEY_KINDS, scale=K**-0.5))
    g = data.draw(st.one_of(st.none(), log_decays((B, T, H))), label="g")
    S0 = data.draw(st.one_of(st.none(), states((B, H, V, K))), label="initial_state")
    chunk = data.draw(st.integers(1, T + 3), label="chunk_size")
    scale = data.draw(st.one_of(st.none(), st.just(1.0)), label="scale")

    ref = delta_rule_recurrence(q, k, v, beta, write_key=write_key, g=g, scale=scale, initial_state=S0)
    o, S = chunk_delta_rule(
        q, k, v, beta, write_key=write_key, g=g, chunk_size=chunk, scale=scale, initial_state=S0
    )
    for ours, theirs in ((o, ref.o), (S, ref.final_state)):
        assert ours.shape == theirs.shape
        tol = 1e-10 * (1.0 + theirs.abs().max().item())
        assert_close(ours, theirs, rtol=1e-10, atol=tol)


def test_chunk_sizes_not_dividing_T_are_covered():
    """A deterministic companion to the property: T = 7 with chunks 1..10 (incl. 3, 4, 5, 6 that leave a
    ragged last chunk, and sizes beyond T)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, K, V = 2, 7, 2, 3, 2
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    wk = k * (0.5 + 1.5 * torch.rand(B, T, H, K, generator=g, dtype=torch.float64))
    gate = -torch.rand(B, T, H, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, H, V, K, generator=g, dtype=torch.float64)
    ref = delta_rule_recurrence(q, k, v, beta, write_key=wk, g=gate, initial_state=S0)
    for c in range(1, 11):
        o, S = chunk_delta_rule(q, k, v, beta, write_key=wk, g=gate, chunk_size=c, initial_state=S0)
        assert_close(o, ref.o, rtol=1e-10, atol=1e-10)
        assert_close(S, ref.final_state, rtol=1e-10, atol=1e-10)
