"""cu_seqlens packing: 2–3 packed sequences (some of length 0 or 1) replay exactly as each one alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from osdn_strategies import (
    WRAPPERS,
    cu_seqlens_of,
    run_wrapper,
    segment_lengths,
    states,
    wrapper_inputs,
)
from torch.testing import assert_close

PER_TOKEN = ("o", "loss_before", "loss_after", "write_gain", "loss_before_decayed")


@pytest.mark.parametrize("name", WRAPPERS)
@given(data=st.data())
def test_packed_segments_replay_as_each_segment_alone(name, data):
    lens = data.draw(segment_lengths(max_len=5))
    N, T = len(lens), sum(lens)
    x, D = data.draw(wrapper_inputs(B=(1, 1), T_fixed=T))
    S0 = data.draw(st.one_of(st.none(), states((N, D.H, D.V, D.K))), label="initial_state")
    cu = cu_seqlens_of(lens, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    packed = run_wrapper(name, **x, initial_state=S0, cu_seqlens=cu)
    assert packed.final_state.shape == (N, D.H, D.V, D.K)
    assert packed.o.shape == (1, T, D.H, D.V)
    offs = cu.tolist()
    for n, (bos, eos) in enumerate(zip(offs[:-1], offs[1:])):
        seg = {key: val[:, bos:eos] for key, val in x.items()}
        alone = run_wrapper(name, **seg, initial_state=None if S0 is None else S0[n : n + 1])
        for f in PER_TOKEN:
            a, b = getattr(packed, f), getattr(alone, f)
            if b is None:
                assert a is None, f
                continue
            assert_close(a[:, bos:eos], b, rtol=1e-13, atol=1e-13, msg=f)
        assert_close(packed.final_state[n : n + 1], alone.final_state, rtol=1e-13, atol=1e-13)
        if eos == bos:  # an empty sequence leaves its initial state untouched
            expected = torch.zeros_like(alone.final_state) if S0 is None else S0[n : n + 1]
            assert torch.equal(packed.final_state[n : n + 1], expected)


@pytest.mark.parametrize("K", [16, 64, 128])
@pytest.mark.parametrize("gate", [None, "head", "channel"])
def test_a_batch_row_is_bit_for_bit_the_row_alone(K, gate):
    """``--batch-size`` must not change a prompt's numbers: each row of a batch (and each packed
    sequence) is computed exactly as it would be alone — in fp32, bit for bit, not merely close."""
    from osdn_diag.math.recurrence import delta_rule_recurrence

    gen = torch.Generator().manual_seed(K)
    B, T, H = 5, 12, 3
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    beta = torch.rand(B, T, H, generator=gen)
    g = None if gate is None else -torch.rand(B, T, H, *([K] if gate == "channel" else []), generator=gen)
    whole = delta_rule_recurrence(q, k, v, beta, g=g)
    packed = delta_rule_recurrence(*(x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, beta)),
                                   g=None if g is None else g.reshape(1, B * T, *g.shape[2:]),
                                   cu_seqlens=torch.arange(0, B * T + 1, T))
    for b in range(B):
        alone = delta_rule_recurrence(q[b:b + 1], k[b:b + 1], v[b:b + 1], beta[b:b + 1],
                                      g=None if g is None else g[b:b + 1])
        for name in ("o", "loss_before", "loss_after", "final_state"):
            a = getattr(alone, name)[0]
            assert torch.equal(getattr(whole, name)[b], a), (name, b)
            p = getattr(packed, name)
            assert torch.equal(p[b] if name == "final_state" else p[0, b * T:(b + 1) * T], a), (name, b)
