"""Fused replay kernel: the delta-rule recurrence with its per-token residual norms, in one pass.

One program owns one (sequence, head, V-block): the state's ``BV`` rows (``S`` is ``V×K``) live in
registers for the whole sequence, held key-major as a ``[K, BV]`` tile. The orientation is most of
the kernel's speed: Triton compiles the three K-reductions per token of a key-major tile with 17
warp shuffles in the whole kernel, against 126 for a ``[BV, K]`` tile (H200, K = V = 128: 3.04 ms
against 4.72 ms; ``benchmarks/RESULTS.md``). Per token it computes, explicitly from the
state (never from Lemma 4.1's identity, which replay exists to check)::

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

from .._checks import check_cu_seqlens
from .._interpret import check_launchable
from ..math.recurrence import RecurrenceResult
from ._common import sequence_bounds

__all__ = ["fused_replay"]


@triton.jit
def _load_token(q, k, v, beta, alpha, wk, tok, o_k, o_v, m_k, m_v, scale,
                K: tl.constexpr, V: tl.constexpr, GATE: tl.constexpr, HAS_WK: tl.constexpr):
    """Token ``tok``'s inputs: k, scaled q, v, β, write key, decay (1 without a gate)."""
    b_k = tl.load(k + tok * K + o_k, mask=m_k, other=0.0)
    b_q = tl.load(q + tok * K + o_k, mask=m_k, other=0.0) * scale
    b_v = tl.load(v + tok * V + o_v, mask=m_v, other=0.0)
    b_beta = tl.load(beta + tok)
    if HAS_WK:
        b_w = tl.load(wk + tok * K + o_k, mask=m_k, other=0.0)
    else:
        b_w = b_k
    if GATE == 1:
        b_a = tl.load(alpha + tok + o_k * 0)  # broadcast over the key lanes, like the channel gate
    elif GATE == 2:
        b_a = tl.load(alpha + tok * K + o_k, mask=m_k, other=1.0)
    else:
        b_a = b_k * 0.0 + 1.0
    return b_k, b_q, b_v, b_beta, b_w, b_a


@triton.jit
def _replay_kernel(
    q, k, v, beta, alpha, wk, h0, cu_seqlens, scale,
    o, lb, lbd, la, gain, ht,
    T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr,          # 0: none, 1: head scalar [B, T, H], 2: key channel [B, T, H, K]
    # (``alpha`` is the decay exp(g), exponentiated by torch in the replay dtype: Triton's fp64 exp
    # lost precision on the H200, failing the fp64 comparison)
    HAS_WK: tl.constexpr, HAS_H0: tl.constexpr, VARLEN: tl.constexpr,
    PREFETCH: tl.constexpr,      # load token t+1's inputs while token t is computed
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = sequence_bounds(cu_seqlens, i_n, T, VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32).to(q.dtype.element_ty)
    if HAS_H0:
        p_h0 = h0 + i_nh.to(tl.int64) * V * K + o_v[None, :] * K + o_k[:, None]
        S += tl.load(p_h0, mask=m_s, other=0.0)

    NV = tl.num_programs(0)
    # The read-out scale comes as a one-element tensor in the replay dtype: a Python float would
    # reach Triton as fp32, too coarse for the fp64 replay.
    b_scale = tl.load(scale)
    # Token t+1's inputs are loaded while token t is computed: the loop is a chain of dependent
    # reductions, and the loads would otherwise sit on it.
    # (Indices are clamped to the sequence's last token instead of masked: the prefetch past the
    # end reads that token again and is never used.)
    last = tl.maximum(eos - 1, 0) * H + i_h
    n_k, n_q, n_v, n_beta, n_w, n_a = _load_token(q, k, v, beta, alpha, wk, tl.minimum(bos * H + i_h, last),
                                                  o_k, o_v, m_k, m_v, b_scale, K, V, GATE, HAS_WK)
    for t in range(bos, eos):
        tok = t * H + i_h                      # index into [B*T, H]
        if PREFETCH:
            b_k, b_q, b_v, b_beta, b_w, b_a = n_k, n_q, n_v, n_beta, n_w, n_a
            n_k, n_q, n_v, n_beta, n_w, n_a = _load_token(q, k, v, beta, alpha, wk, tl.minimum(tok + H, last),
                                                          o_k, o_v, m_k, m_v, b_scale, K, V, GATE, HAS_WK)
        else:
            b_k, b_q, b_v, b_beta, b_w, b_a = _load_token(q, k, v, beta, alpha, wk, tok,
                                                          o_k, o_v, m_k, m_v, b_scale, K, V, GATE, HAS_WK)
        e = tl.sum(S * b_k[:, None], axis=0) - b_v
        tl.store(lb + tok * NV + i_v, 0.5 * tl.sum(e * e, axis=0))
        if i_v == 0:
            # The write gain β⟨k̃, k⟩ does not depend on the state: one V-block reports it, off the
            # chain of dependent reductions (in torch it cost more than the reduction: a K-wide
            # temporary per token).
            tl.store(gain + tok, b_beta * tl.sum(b_w * b_k, axis=0))
        if GATE != 0:
            S = S * b_a[:, None]
        if GATE != 0:
            u = b_v - tl.sum(S * b_k[:, None], axis=0)
            tl.store(lbd + tok * NV + i_v, 0.5 * tl.sum(u * u, axis=0))
        else:
            u = -e
        S += b_w[:, None] * (b_beta * u)[None, :]
        e = tl.sum(S * b_k[:, None], axis=0) - b_v
        tl.store(la + tok * NV + i_v, 0.5 * tl.sum(e * e, axis=0))
        tl.store(o + tok * V + o_v, tl.sum(S * b_q[:, None], axis=0), mask=m_v)
    p_ht = ht + i_nh.to(tl.int64) * V * K + o_v[None, :] * K + o_k[:, None]
    tl.store(p_ht, S, mask=m_s)


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

    Returns a :class:`~osdn_diag.math.recurrence.RecurrenceResult`: outputs ``[B, T, H, V]``, the
    losses before and after each write ``[B, T, H]``, the final state ``[N, H, V, K]``.

    ``block_v`` (rows of the state per program) and ``num_warps`` override the launch configuration
    (``benchmarks/bench_replay.py --sweep`` measures the choices). ``cu_seqlens`` is checked in
    full (int32/int64 on ``q``'s device, 0 to T without decreasing) before the launch; CPU tensors
    need the kernel built for Triton's interpreter (``RuntimeError`` otherwise)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else len(check_cu_seqlens(cu_seqlens, B, T, q.device)) - 1
    check_launchable("fused_replay", q.device, _replay_kernel)
    cast = lambda x: None if x is None else x.to(dtype).contiguous()  # noqa: E731
    q, k, v, beta, g, wk, h0 = map(cast, (q, k, v, beta, g, write_key, initial_state))
    alpha = None if g is None else g.exp()
    scale_t = torch.full((1,), K**-0.5 if scale is None else scale, dtype=dtype, device=q.device)
    BK = triton.next_power_of_2(K)
    # Many narrow programs: the sweep in benchmarks/bench_replay.py (H200) measured 8 rows × 1 warp
    # fastest at K = V = 64, 128 and 256 (at 128: 3.04 ms, against 5.30 ms for 32 rows × 1 warp).
    BV = block_v or min(triton.next_power_of_2(V), 8)
    num_warps = num_warps or 1
    prefetch = True if prefetch is None else prefetch
    NV = triton.cdiv(V, BV)
    o = torch.empty_like(v)
    # Tokens outside every packed sequence are never written: zeros, not garbage, there.
    parts = torch.zeros(3, B * T * H, NV, dtype=dtype, device=q.device)
    gain = torch.zeros(B, T, H, dtype=dtype, device=q.device)
    ht = torch.empty(N, H, V, K, dtype=dtype, device=q.device)
    dummy = q.new_empty(1)
    gate = 0 if g is None else (1 if g.dim() == 3 else 2)
    _replay_kernel[(NV, N * H)](
        q, k, v, beta,
        dummy if alpha is None else alpha,
        dummy if wk is None else wk,
        dummy if h0 is None else h0,
        cu_seqlens if cu_seqlens is not None else dummy,
        scale_t,
        o, parts[0], parts[1], parts[2], gain, ht,
        T, H=H, K=K, V=V, BK=BK, BV=BV,
        GATE=gate, HAS_WK=wk is not None, HAS_H0=h0 is not None, VARLEN=cu_seqlens is not None,
        PREFETCH=prefetch, num_warps=num_warps,
    )
    before, before_dec, after = (p.sum(-1).view(B, T, H) for p in parts)
    return RecurrenceResult(
        o=o,
        final_state=ht,
        loss_before=before,
        loss_after=after,
        write_gain=gain,
        loss_before_decayed=None if g is None else before_dec,
    )
