"""Fused replay kernel: the delta-rule recurrence with its per-token residual norms, in one pass.

One program owns one (sequence, head, V-block): the state's ``BV`` rows (``S`` is ``V×K``) live in
registers for the whole sequence, held key-major as a ``[P, BK/(KL·P), BV, KL]`` tile whose last
axis, ``KL`` "key lanes", is spread over the warp's lanes. The layout is most of the kernel's speed:
each product ``S x`` is a sum in each thread's registers, split into ``P`` "key groups" of
independent partial sums, followed by log2(KL) rounds of shuffles, and a key vector costs ``BK/KL``
registers per thread. Holding keys across all 32 lanes ([BV, K], as fla's fused recurrent kernel
does) costs 126 shuffles in the kernel against 17 (H200, K = V = 128: 4.72 ms against 3.04 ms). The
token loop's loads are either pipelined by Triton through shared memory (up to K = 128: with 16 rows,
4 key groups and contiguous keys per lane, 2.55 ms at K = V = 128 against 3.11 ms with the
register prefetch of 8 rows, and 1.12× fla's gated kernel with a head gate where that layout ran
0.93×) or prefetched into registers a token ahead (K = 256, where 16 rows per program with 4 key
lanes ran 1.29× fla's kernel and 8 rows 0.81×); ``benchmarks/CHANGELOG.md`` (series 13, 15) has the sweeps.

Per token it computes, explicitly from the state (never from Lemma 4.1's identity, which replay
exists to check)::

    e_before = S_{t−1} k_t − v_t                 → ½‖e_before‖²   (loss_before, this V-block's part)
    S̄        = decay(S_{t−1})                     (scalar or key-channel gate, if any)
    u        = v_t − S̄ k_t                       → ½‖u‖²          (loss_before_decayed)
    S_t      = S̄ + β_t u k̃_tᵀ
    e_after  = S_t k_t − v_t                     → ½‖e_after‖²    (loss_after)
    o_t      = S_t (scale · q_t)

Each V-block writes its partial sums; the wrapper adds the blocks. The plain reference is
:func:`osdn_diag.math.recurrence.delta_rule_recurrence`; tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime.checks import check_cu_seqlens, check_recurrence_inputs, check_shape
from ..runtime.interpret import check_launchable
from ..math.recurrence import RecurrenceResult
from ._common import as_int, finite_scale, power_of_two, replay_result, sequence_bounds

__all__ = ["STATE_ENTRIES", "fused_replay"]

#: The most fp32 state entries a one-warp program holds (32 registers per lane): wider keys get fewer
#: state rows per program, where more would spill.
STATE_ENTRIES = 4096


@triton.jit
def _load_token(q, k, v, beta, alpha, wk, tok, o_k, o_v, m_k, m_v, scale,
                K: tl.constexpr, V: tl.constexpr, GATE: tl.constexpr, HAS_WK: tl.constexpr):
    """Token ``tok``'s inputs: k, scaled q and write key as ``[P, A, KL]`` key tiles, v, β, and the
    decay (a scalar for the head gate, a key tile for the channel gate, 1 without a gate)."""
    b_k = tl.load(k + tok * K + o_k, mask=m_k, other=0.0)
    b_q = tl.load(q + tok * K + o_k, mask=m_k, other=0.0) * scale
    b_v = tl.load(v + tok * V + o_v, mask=m_v, other=0.0)
    b_beta = tl.load(beta + tok)
    if HAS_WK:
        b_w = tl.load(wk + tok * K + o_k, mask=m_k, other=0.0)
    else:
        b_w = b_k
    if GATE == 1:
        b_a = tl.load(alpha + tok)
    elif GATE == 2:
        b_a = tl.load(alpha + tok * K + o_k, mask=m_k, other=1.0)
    else:
        b_a = b_beta * 0.0 + 1.0  # unused
    return b_k, b_q, b_v, b_beta, b_w, b_a


@triton.jit
def _matvec(S, x):
    """``S x`` for a state tile ``[P, A, BV, KL]`` and a key tile ``x`` ``[P, A, KL]``: ``[BV]``. The
    sums over ``A`` come first (``P`` independent partial sums), then over ``P``, then over ``KL``."""
    return tl.sum(tl.sum(tl.sum(S * x[:, :, None, :], axis=1), axis=0), axis=1)


@triton.jit
def _replay_kernel(
    q, k, v, beta, alpha, wk, h0, cu_seqlens, scale,
    o, lb, lbd, la, gain, ht,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    KL: tl.constexpr,            # key lanes: the state tile is [P, BK // (KL·P), BV, KL]
    P: tl.constexpr,             # key groups: each product is P partial sums, added last
    GATE: tl.constexpr,          # 0: none, 1: head scalar [B, T, H], 2: key channel [B, T, H, K]
    # (``alpha`` is the decay exp(g), exponentiated by torch in the replay dtype: Triton's fp64 exp
    # lost precision on the H200, failing the fp64 comparison)
    HAS_WK: tl.constexpr, HAS_H0: tl.constexpr, VARLEN: tl.constexpr,
    PREFETCH: tl.constexpr,      # load token t+1's inputs into registers while token t is computed
    STAGES: tl.constexpr,        # > 0: Triton pipelines the loop's loads, STAGES deep (not with PREFETCH)
    CONTIGUOUS: tl.constexpr,    # key lane b holds keys [b·BK/KL, (b+1)·BK/KL), not every KL-th key
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = sequence_bounds(cu_seqlens, i_n, T, VARLEN)
    A: tl.constexpr = BK // KL // P
    # Key index (p·A + a)·KL + b (or, CONTIGUOUS, b·BK/KL + p·A + a) sits at [p, a, b] of a key
    # tile and at [p, a, :, b] of the state tile, whose last axis is spread over the warp's lanes.
    # KL sets the trade between lanes and registers: a key vector costs BK/KL registers per thread
    # and each product S·x ends in log2(KL) rounds of shuffles. P splits each product's sum over a
    # thread's keys into P independent partial sums: the sum is a chain of dependent adds, and P
    # chains of A/P run side by side. Contiguous keys let a lane read its keys of a pipelined load
    # from shared memory as 128-bit vectors.
    if CONTIGUOUS:
        o_k = tl.arange(0, P)[:, None, None] * A + tl.arange(0, A)[None, :, None] + tl.arange(0, KL)[None, None, :] * (P * A)
    else:
        o_k = (tl.arange(0, P)[:, None, None] * A + tl.arange(0, A)[None, :, None]) * KL + tl.arange(0, KL)[None, None, :]
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    o_s = o_v[None, None, :, None] * K + o_k[:, :, None, :]  # S[v, key], V×K row-major
    m_s = m_v[None, None, :, None] & m_k[:, :, None, :]

    S = tl.zeros([P, A, BV, KL], dtype=tl.float32).to(q.dtype.element_ty)
    if HAS_H0:
        S += tl.load(h0 + i_nh.to(tl.int64) * V * K + o_s, mask=m_s, other=0.0)

    NV = tl.num_programs(0)
    # The read-out scale comes as a one-element tensor in the replay dtype: a Python float would
    # reach Triton as fp32, too coarse for the fp64 replay.
    b_scale = tl.load(scale)
    # The loop is a chain of dependent reductions, and loads would otherwise sit on it: either
    # token t+1's inputs are loaded into registers while token t is computed (PREFETCH), or Triton
    # pipelines the loads through shared memory, STAGES - 1 tokens ahead.
    # (Indices are clamped to the sequence's last token instead of masked: the prefetch past the
    # end reads that token again and is never used.)
    if PREFETCH:
        last = tl.maximum(eos - 1, 0) * H + i_h
        n_k, n_q, n_v, n_beta, n_w, n_a = _load_token(q, k, v, beta, alpha, wk, tl.minimum(bos * H + i_h, last),
                                                      o_k, o_v, m_k, m_v, b_scale, K, V, GATE, HAS_WK)
    for t in tl.range(bos, eos, num_stages=STAGES if STAGES > 0 else None):
        tok = t * H + i_h                      # index into [B*T, H]
        if PREFETCH:
            b_k, b_q, b_v, b_beta, b_w, b_a = n_k, n_q, n_v, n_beta, n_w, n_a
            n_k, n_q, n_v, n_beta, n_w, n_a = _load_token(q, k, v, beta, alpha, wk, tl.minimum(tok + H, last),
                                                          o_k, o_v, m_k, m_v, b_scale, K, V, GATE, HAS_WK)
        else:
            b_k, b_q, b_v, b_beta, b_w, b_a = _load_token(q, k, v, beta, alpha, wk, tok,
                                                          o_k, o_v, m_k, m_v, b_scale, K, V, GATE, HAS_WK)
        s_k = _matvec(S, b_k)                  # S_{t-1} k
        e = s_k - b_v
        tl.store(lb + tok * NV + i_v, 0.5 * tl.sum(e * e, axis=0))
        if i_v == 0:
            # The write gain β⟨k̃, k⟩ does not depend on the state: one V-block reports it, off the
            # chain of dependent reductions (in torch it cost more than the reduction: a K-wide
            # temporary per token).
            tl.store(gain + tok, b_beta * tl.sum(tl.sum(tl.sum(b_w * b_k, axis=2), axis=1), axis=0))
        # The decayed state S̄ = α S (head gate) applied to k as α (S k), by linearity, from the
        # product above; the key-channel gate's S̄ = S Diag(α) is formed first (a second product
        # S (α ⊙ k) of the undecayed state instead took 4.84 ms against 4.26 ms on the H200 at
        # K = V = 128, 8 rows and 4 key lanes).
        if GATE == 1:
            u = b_v - b_a * s_k
            S = S * b_a
        elif GATE == 2:
            S = S * b_a[:, :, None, :]
            u = b_v - _matvec(S, b_k)
        else:
            u = -e
        if GATE != 0:
            tl.store(lbd + tok * NV + i_v, 0.5 * tl.sum(u * u, axis=0))
        S += b_w[:, :, None, :] * (b_beta * u)[None, None, :, None]
        e = _matvec(S, b_k) - b_v              # S_t k − v, from the updated state itself
        tl.store(la + tok * NV + i_v, 0.5 * tl.sum(e * e, axis=0))
        tl.store(o + tok * V + o_v, _matvec(S, b_q), mask=m_v)
    tl.store(ht + i_nh.to(tl.int64) * V * K + o_s, S, mask=m_s)


def _default_launch(BK: int, V: int, gate: int, dtype: torch.dtype) -> dict:
    """The launch configuration by padded key width, from ``benchmarks/bench_replay.py --sweep``
    (H200, B = 8, T = 4,096, H = 8; fp32; ``benchmarks/RESULTS.md``). Up to K = 128 Triton pipelines
    the loads (3 stages): one-warp programs of 8 state rows and 2 key lanes at K ≤ 64; at K = 128,
    16 rows (half the programs, one row per lane) with 4 key groups and contiguous keys. At K = 256,
    16 rows, 4 key lanes (8 with the key-channel gate) and the register prefetch: the pipelined
    loads were no faster there. Wider keys keep a program's state at 4,096 entries (2,048 in fp64)
    so that it stays in registers."""
    entries = STATE_ENTRIES if dtype != torch.float64 else STATE_ENTRIES // 2
    if BK <= 64:
        rows, lanes, groups, stages, contiguous = 8, 2, 1, 3, False
    elif BK <= 128:
        rows, lanes, groups, stages, contiguous = 16, 2, 4, 3, True
    else:
        rows, lanes, groups, stages, contiguous = max(entries // BK, 1), 8 if gate == 2 else 4, 1, 0, False
    return dict(block_v=min(triton.next_power_of_2(V), rows), key_lanes=lanes, key_groups=groups, stages=stages,
                contiguous_keys=contiguous)


def _resolve_launch(launch: dict, BK: int, *, block_v, key_lanes, key_groups, stages, contiguous_keys, prefetch):
    """``(BV, KL, P, stages, contiguous_keys, prefetch)``: the options given, the defaults ``launch``
    for the rest, checked. An explicit ``prefetch`` with no ``stages`` means the register prefetch
    (``True``) or no prefetch (``False``), both unpipelined; ``prefetch=True`` with ``stages > 0`` asks
    for two ways of loading ahead at once and is refused."""
    if stages is not None:
        given, stages = stages, as_int(stages)
        if stages is None or stages < 0:
            raise ValueError(f"fused_replay: stages must be an integer, 0 or more, got {given!r}")
    if prefetch and stages:
        raise ValueError(f"fused_replay: prefetch=True (the register prefetch) and stages={stages} (loads pipelined "
                         "by Triton) are two ways of loading ahead: give one of them")
    if prefetch is not None and stages is None:
        stages = 0
    block_v, key_lanes, key_groups, stages, contiguous_keys = (
        launch[n] if x is None else x
        for n, x in (("block_v", block_v), ("key_lanes", key_lanes), ("key_groups", key_groups), ("stages", stages),
                     ("contiguous_keys", contiguous_keys)))
    checked = [power_of_two("fused_replay", name, value)
               for name, value in (("block_v", block_v), ("key_lanes", key_lanes), ("key_groups", key_groups))]
    block_v, key_lanes, key_groups = checked
    if key_lanes > 32:  # the lanes of one warp
        raise ValueError(f"fused_replay: key_lanes must be at most 32 (a warp's lanes), got {key_lanes}")
    KL = min(key_lanes, BK)
    prefetch = stages == 0 if prefetch is None else prefetch
    return block_v, KL, min(key_groups, BK // KL), stages, bool(contiguous_keys), prefetch


def _warps(num_warps) -> int:
    """``num_warps`` checked: ``None`` is one warp; else a power of two from 1 to 32 (an int, or
    anything that is one, but not a bool)."""
    return 1 if num_warps is None else power_of_two("fused_replay", "num_warps", num_warps, 1, 32)


def fused_replay(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    write_key: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    block_v: int | None = None,
    num_warps: int | None = None,
    prefetch: bool | None = None,
    key_lanes: int | None = None,
    key_groups: int | None = None,
    stages: int | None = None,
    contiguous_keys: bool | None = None,
) -> RecurrenceResult:
    """The delta-rule recurrence with both residual norms of every write, fused: the contract of
    :func:`osdn_diag.math.recurrence.delta_rule_recurrence`, computed by one Triton kernel in
    ``dtype`` (fp32 or fp64) on ``q``'s device (CUDA; the CPU under Triton's interpreter).

    Args:
        q, k: ``[B, T, H, K]`` queries and read keys, as the kernel read them (no normalisation here).
        v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
        write_key: ``[B, T, H, K]`` (OSDN's ``d ⊙ k``) or ``None`` (the read key writes).
        g: log decay, ``[B, T, H]`` (head gate) or ``[B, T, H, K]`` (channel gate), or ``None``.
        initial_state: ``[N, H, V, K]`` (``V×K`` per head) or ``None`` (zeros).
        cu_seqlens: ``[N + 1]`` packed sequence bounds with ``B = 1``, or ``None`` (``N = B``).
        scale: multiplies ``q`` in the read-out, a finite number (NaN, ±inf: ``ValueError``), or
            ``None`` for ``K^-1/2``.

    Returns a :class:`~osdn_diag.math.recurrence.RecurrenceResult`: outputs ``[B, T, H, V]``, the
    losses before and after each write ``[B, T, H]``, the final state ``[N, H, V, K]``.

    ``block_v`` (rows of the state per program), ``key_lanes`` (the lanes of a warp a key is spread
    over: a power of two), ``key_groups`` (the partial sums each product's in-thread sum is split
    into: a power of two), ``contiguous_keys`` (each key lane holds a contiguous run of keys, not
    every ``key_lanes``-th), ``stages`` (Triton pipelines the token loop's loads that many stages
    deep; 0: the kernel's own register prefetch of the next token, ``prefetch=True``, or none,
    ``prefetch=False``; giving ``prefetch`` alone implies ``stages=0``, and ``prefetch=True`` with
    ``stages > 0`` is refused) and ``num_warps`` (a power of two, 1 to 32) override the launch
    configuration (``benchmarks/bench_replay.py --sweep`` measures the choices). ``cu_seqlens`` is checked in
    full (int32/int64 on ``q``'s device, 0 to T without decreasing) before the launch; CPU tensors
    need the kernel built for Triton's interpreter (``RuntimeError`` otherwise)."""
    B, T, H, K, V = check_recurrence_inputs(q, k, v, beta, write_key, g, device=q.device,
                                            initial_state=initial_state)
    if K < 1 or V < 1:
        raise ValueError(f"fused_replay: keys and values need at least one channel, got K = {K} (k's last "
                         f"dimension) and V = {V} (v's)")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"fused_replay: dtype must be torch.float32 or torch.float64, got {dtype}")
    finite_scale("fused_replay", scale)
    BK = triton.next_power_of_2(K)
    gate = 0 if g is None else (1 if g.dim() == 3 else 2)
    # The launch options are checked before any input is copied.
    BV, KL, P, stages, contiguous_keys, prefetch = _resolve_launch(
        _default_launch(BK, V, gate, dtype), BK, block_v=block_v, key_lanes=key_lanes, key_groups=key_groups,
        stages=stages, contiguous_keys=contiguous_keys, prefetch=prefetch)
    num_warps = _warps(num_warps)
    N = B if cu_seqlens is None else len(check_cu_seqlens(cu_seqlens, B, T, q.device)) - 1
    if initial_state is not None:  # fla's [N, H, K, V] would pass through the kernel unnoticed
        check_shape("initial_state", initial_state, [N, H, V, K], "[N, H, V, K]")
    check_launchable("fused_replay", q.device, _replay_kernel)
    cast = lambda x: None if x is None else x.to(dtype).contiguous()  # noqa: E731
    q, k, v, beta, g, wk, h0 = map(cast, (q, k, v, beta, g, write_key, initial_state))
    alpha = None if g is None else g.exp()
    scale_t = torch.full((1,), K**-0.5 if scale is None else scale, dtype=dtype, device=q.device)
    NV = triton.cdiv(V, BV)
    o = torch.empty_like(v)
    # Tokens outside every packed sequence are never written: zeros, not garbage, there.
    parts = torch.zeros(3, B * T * H, NV, dtype=dtype, device=q.device)
    gain = torch.zeros(B, T, H, dtype=dtype, device=q.device)
    if B * T == 0:  # no token: nothing to launch (the register prefetch loads a first token unconditionally)
        # the initial state back, not attached to any graph
        ht = torch.zeros(N, H, V, K, dtype=dtype, device=q.device) if h0 is None else h0.detach().clone()
        return replay_result(o, ht, parts, gain, gated=g is not None)
    ht = torch.empty(N, H, V, K, dtype=dtype, device=q.device)
    dummy = q.new_empty(1)
    _replay_kernel[(NV, N * H)](
        q, k, v, beta,
        dummy if alpha is None else alpha,
        dummy if wk is None else wk,
        dummy if h0 is None else h0,
        cu_seqlens.contiguous() if cu_seqlens is not None else dummy,  # a strided view would be read as packed
        scale_t,
        o, parts[0], parts[1], parts[2], gain, ht,
        T, H=H, K=K, V=V, BK=BK, BV=BV, KL=KL, P=P,
        GATE=gate, HAS_WK=wk is not None, HAS_H0=h0 is not None, VARLEN=cu_seqlens is not None,
        PREFETCH=prefetch, STAGES=stages, CONTIGUOUS=contiguous_keys, num_warps=num_warps,
    )
    return replay_result(o, ht, parts, gain, gated=g is not None)
