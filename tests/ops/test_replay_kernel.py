"""The fused replay kernel against the fp64 reference recurrence (CPU: Triton interpreter; GPU: real)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from osdn_diag.math import delta_rule_recurrence

from _replay_cases import FIELDS
from _replay_cases import assert_close as _assert_close
from _replay_cases import assert_fields_close as _assert_fields_close
from _replay_cases import replay_inputs as _inputs

ops_replay = pytest.importorskip("osdn_diag.ops.replay", reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "B,T,H,K,V,gate,asym,h0",
    [
        (1, 1, 1, 8, 8, None, False, False),
        (2, 19, 2, 8, 12, None, True, True),
        (1, 23, 2, 12, 16, "head", True, False),
        (2, 17, 1, 16, 8, "channel", True, True),
        (1, 9, 3, 32, 32, "head", False, True),
    ],
)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
@pytest.mark.parametrize("key_lanes", [4, 16], ids=["kl4", "kl16"])
def test_fused_replay_matches_reference(B, T, H, K, V, gate, asym, h0, dtype, tol, prefetch, key_lanes):
    q, k, v, beta, kw = _inputs(B * 1000 + T, B, T, H, K, V, gate=gate, asym=asym, h0=h0)
    ref = delta_rule_recurrence(q, k, v, beta, **kw)
    dev = {n: x.to(DEVICE) for n, x in kw.items()}
    got = ops_replay.fused_replay(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), beta.to(DEVICE), dtype=dtype, block_v=8,
        prefetch=prefetch, key_lanes=key_lanes, **dev
    )
    _assert_fields_close(got, ref, tol)


@pytest.mark.parametrize(
    "B,T,H,K,V,gate,asym,h0",
    [(2, 19, 2, 8, 12, None, True, True), (1, 23, 2, 12, 16, "head", True, False), (2, 17, 1, 16, 8, "channel", True, True),
     (1, 11, 2, 12, 20, "channel", True, True)],  # padded keys (K < 16), V not a multiple of the rows
)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
# (2, 4): four partial sums of a thread's keys; (1, 8): one key lane, every key in one thread; (4, 16):
# more groups than a thread has keys (clamped to one key per group). Each with the loads pipelined by
# Triton (stages 3; under the interpreter, plain loads in the loop) and contiguous keys per lane, or
# interleaved keys with the register prefetch.
@pytest.mark.parametrize("key_lanes,key_groups", [(2, 4), (1, 8), (4, 16)], ids=["kl2-kg4", "kl1-kg8", "kl4-kg16"])
@pytest.mark.parametrize("stages,contiguous", [(3, True), (0, False)], ids=["pipelined-contiguous", "prefetch"])
def test_fused_replay_key_groups_match_reference(B, T, H, K, V, gate, asym, h0, dtype, tol, key_lanes, key_groups,
                                                 stages, contiguous):
    """Each product split into key groups (partial sums added last) against the fp64 reference."""
    q, k, v, beta, kw = _inputs(B * 1000 + T + 1, B, T, H, K, V, gate=gate, asym=asym, h0=h0)
    ref = delta_rule_recurrence(q, k, v, beta, **kw)
    got = ops_replay.fused_replay(
        q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), beta.to(DEVICE), dtype=dtype, block_v=16,
        key_lanes=key_lanes, key_groups=key_groups, stages=stages, contiguous_keys=contiguous,
        **{n: x.to(DEVICE) for n, x in kw.items()}
    )
    _assert_fields_close(got, ref, tol)


def test_fused_replay_packed_sequences_restart():
    q, k, v, beta, kw = _inputs(7, 1, 30, 2, 8, 8, gate="head", asym=True, h0=False)
    cu = torch.tensor([0, 11, 11, 30])  # includes an empty segment
    h0 = torch.randn(3, 2, 8, 8, dtype=torch.float64)
    ref = delta_rule_recurrence(q, k, v, beta, initial_state=h0, cu_seqlens=cu, **kw)
    got = ops_replay.fused_replay(
        *(x.to(DEVICE) for x in (q, k, v, beta)),
        initial_state=h0.to(DEVICE),
        cu_seqlens=cu.to(DEVICE),
        **{n: x.to(DEVICE) for n, x in kw.items()},
    )
    for name in FIELDS:
        _assert_close(getattr(got, name), getattr(ref, name), name, 1e-5)


def test_fused_replay_zero_residuals():
    """v = 0 from a zero state: every loss is exactly zero, never NaN."""
    q, k, v, beta, _ = _inputs(3, 1, 12, 1, 8, 8, gate=None, asym=False, h0=False)
    got = ops_replay.fused_replay(*(x.to(DEVICE) for x in (q, k, torch.zeros_like(v), beta)))
    assert torch.equal(got.loss_before.cpu(), torch.zeros(1, 12, 1, dtype=torch.float32))
    assert torch.equal(got.loss_after.cpu(), torch.zeros(1, 12, 1, dtype=torch.float32))


@pytest.mark.parametrize(
    "K,gate,dtype",
    [(256, None, torch.float32), (256, "head", torch.float32), (256, "channel", torch.float32),
     (128, "head", torch.float32), (128, "channel", torch.float64), (100, "channel", torch.float32),
     (64, "channel", torch.float32), (48, "head", torch.float32)],
)
def test_fused_replay_default_launch_by_key_width(K, gate, dtype):
    """The default launch of each key width (K = 256: 16 state rows, 4 or 8 key lanes, register
    prefetch; K = 128, and K = 100 with its keys padded: 16 rows, 4 key groups, contiguous keys,
    pipelined loads; K <= 64: 8 rows, pipelined) against the fp64 reference, with an initial state
    and a write key."""
    q, k, v, beta, kw = _inputs(K, 1, 5, 2, K, K, gate=gate, asym=True, h0=True)
    ref = delta_rule_recurrence(q, k, v, beta, **kw)
    got = ops_replay.fused_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), dtype=dtype,
                                  **{n: x.to(DEVICE) for n, x in kw.items()})
    for name in FIELDS:
        r = getattr(ref, name)
        if r is not None:
            _assert_close(getattr(got, name), r, name, 1e-5)


@pytest.mark.parametrize("gate,h0", [(None, False), ("channel", True)])
def test_fused_replay_of_no_token(gate, h0):
    """T = 0: the reference's result (empty per-token fields, the initial state back), no launch."""
    B, H, K, V = 2, 2, 8, 8
    q, k, v = torch.zeros(B, 0, H, K, dtype=torch.float64), torch.zeros(B, 0, H, K, dtype=torch.float64), \
        torch.zeros(B, 0, H, V, dtype=torch.float64)
    beta = torch.zeros(B, 0, H, dtype=torch.float64)
    kw = {} if gate is None else {"g": torch.zeros(B, 0, H, K, dtype=torch.float64)}
    if h0:
        kw["initial_state"] = torch.randn(B, H, V, K, dtype=torch.float64)
    ref = delta_rule_recurrence(q, k, v, beta, **kw)
    got = ops_replay.fused_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), **{n: x.to(DEVICE) for n, x in kw.items()})
    for name in FIELDS:
        r, x = getattr(ref, name), getattr(got, name)
        assert (r is None) == (x is None), name
        if r is not None:
            assert x.shape == r.shape, name
            if r.numel():  # the initial state, back in the replay's fp32
                _assert_close(x, r, name, 1e-7)


@pytest.mark.parametrize("option", ["block_v", "key_lanes", "key_groups"])
def test_fused_replay_refuses_a_launch_option_that_is_not_a_power_of_two(option):
    q, k, v, beta, _ = _inputs(1, 1, 3, 1, 8, 8, gate=None, asym=False, h0=False)
    with pytest.raises(ValueError, match=f"{option} must be a power of two, got 3"):
        ops_replay.fused_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), **{option: 3})


def test_fused_replay_takes_numpy_integers_for_launch_options():
    q, k, v, beta, _ = _inputs(1, 1, 3, 1, 8, 8, gate=None, asym=False, h0=False)
    args = [x.to(DEVICE) for x in (q, k, v, beta)]
    plain = ops_replay.fused_replay(*args, block_v=4, key_lanes=2, key_groups=2, num_warps=1)
    given = ops_replay.fused_replay(*args, block_v=np.int64(4), key_lanes=np.int32(2), key_groups=np.int64(2),
                                    num_warps=np.int64(1))
    assert torch.equal(plain.o, given.o) and torch.equal(plain.loss_after, given.loss_after)


@pytest.mark.parametrize("K, V", [(0, 8), (8, 0)])
def test_fused_replay_refuses_keys_or_values_without_channels(K, V):
    q, k = torch.zeros(1, 3, 1, K), torch.zeros(1, 3, 1, K)
    v, beta = torch.zeros(1, 3, 1, V), torch.zeros(1, 3, 1)
    with pytest.raises(ValueError, match=f"at least one channel, got K = {K} .* and V = {V}"):
        ops_replay.fused_replay(*(x.to(DEVICE) for x in (q, k, v, beta)))


@pytest.mark.parametrize("options,message", [
    (dict(prefetch=True, stages=3), r"prefetch=True \(the register prefetch\) and stages=3"),
    (dict(stages=2.5), r"stages must be an integer, 0 or more, got 2.5"),
    (dict(stages=True), r"stages must be an integer, 0 or more, got True"),
    (dict(stages=-1), r"stages must be an integer, 0 or more, got -1"),
    (dict(dtype=torch.float16), r"dtype must be torch.float32 or torch.float64, got torch.float16"),
    (dict(initial_state=torch.zeros(1, 1, 12, 8)), r"initial_state.*\[N, H, V, K\]"),  # fla's [N, H, K, V]
    (dict(num_warps=0), r"num_warps must be a power of two from 1 to 32, got 0"),  # was taken as 1
    (dict(num_warps=3), r"num_warps must be a power of two from 1 to 32, got 3"),
    (dict(num_warps=64), r"num_warps must be a power of two from 1 to 32, got 64"),
    (dict(num_warps=2.0), r"num_warps must be a power of two from 1 to 32, got 2.0"),
    (dict(key_lanes=64), r"key_lanes must be at most 32 \(a warp's lanes\), got 64"),
    (dict(key_lanes=2.0), r"key_lanes must be a power of two, got 2.0"),
    (dict(block_v=True), r"block_v must be a power of two, got True"),
])
def test_fused_replay_refuses_inconsistent_options(options, message):
    """Options that cannot all hold, or that the kernel would take without noticing, are refused
    with a message naming them, before any input is copied."""
    q, k, v, beta, _ = _inputs(1, 1, 3, 1, 12, 8, gate=None, asym=False, h0=False)
    options = {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in options.items()}
    with pytest.raises(ValueError, match=message):
        ops_replay.fused_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), **options)
