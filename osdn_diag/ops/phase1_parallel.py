"""OSDN phase 1, token-parallel: the whole sequence's step sizes as one Picard fixed point.

Phase 1 moves ``d`` by clamped-affine maps, ``d_{t+1} = M_t(d_t) = clamp(r_t d_t + c_t s_t)``, whose
step size ``c_t = α_t − γ_t ⟨d_t, s_t⟩`` depends on ``d_t`` (``s_t = k_t ⊙ k_t``; see
:mod:`osdn_diag.math.phase1_blocked` for the algebra). Given every ``c_t``, the trajectory is one
associative scan of the maps, parallel over tokens and channels; the ``c_t`` are the fixed point of
``c ← α − γ ⊙ ⟨D(c), s⟩``, found by Picard rounds. :mod:`osdn_diag.ops.phase1_blocked` does this
block by block inside one program per (sequence, head), which leaves the GPU mostly idle; here every
round runs over the whole sequence at once, chunk-parallel:

1. *summarise* — one program per (chunk, sequence, head) composes its chunk's maps into one map;
2. *carry* — one program per (sequence, head) applies the chunk maps in order and records the ``d``
   entering each chunk (and the final ``d``);
3. *rescan* — one program per (chunk, sequence, head) applies its chunk's maps from that ``d``,
   token by token, into the trajectory ``D_t``, emits ``k̃_t = D_t ⊙ k_t`` (and ``D_t``), and
   computes the next ``c_t`` and how far it moved.

Within a chunk the work is a short loop over its tokens: with the step sizes fixed, a map acts on
each channel alone, so composing or applying maps needs no exchange between threads, and the one
reduction per token (the next ``c_t``) is off the token-to-token chain. The sequential depth is the
chunk (64 tokens), not the sequence; the chunks of every sequence and head run at once.

The rounds stop when no ``c_t`` moves by more than ``8·eps·(1 + |c_t|)`` (fp32); the first guess
freezes ``d`` at ``d_0``. At the paper's setting (K = 128, η = 0.003) a sequence of 4,096 tokens takes
2 rounds; η = 0.05 takes 6 and η = 0.5 about 23 (measured with the reference,
:func:`osdn_diag.math.phase1_blocked.osdn_phase1_blocked` with one block per sequence). A call whose
rounds have not converged after ``max_rounds`` is computed again by the sequential kernel, so the
result is always phase 1's. Forward only; the reverse sweep of :mod:`osdn_diag.ops.phase1` runs over the
trajectory stored here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .phase1 import MAX_K, _contig, _d0_mode, _params, _ret_mode, phase1_fwd
from .phase1_blocked import _compose

__all__ = ["parallel_fwd"]


@triton.jit
def _bounds(cu_seqlens, i_n, T, VARLEN: tl.constexpr):
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def _load_d0(d0, i_nh, i_h, o_k, m_k, K: tl.constexpr, BK: tl.constexpr, D0: tl.constexpr):
    """d_0 of (sequence, head) ``i_nh``: ones, shared per head ``[H, K]`` or per sequence ``[N, H, K]``."""
    if D0 == 1:
        b_d = tl.load(d0 + i_h * K + o_k, mask=m_k, other=1.0).to(tl.float32)
    elif D0 == 2:
        b_d = tl.load(d0 + i_nh * K + o_k, mask=m_k, other=1.0).to(tl.float32)
    else:
        b_d = tl.full([BK], 1.0, dtype=tl.float32)
    return b_d


@triton.jit
def _box(scalars, BOX: tl.constexpr):
    if BOX:
        d_min = tl.load(scalars + 2)
        d_max = tl.load(scalars + 3)
    else:
        d_min = -float("inf")
        d_max = float("inf")
    return d_min, d_max


@triton.jit
def _token(k, r, c, tok, o_k, m_k, K: tl.constexpr, BK: tl.constexpr, RET: tl.constexpr):
    """Token ``tok``'s key, step size and retention (``[BK]``, scalar, ``[BK]``)."""
    b_k = tl.load(k + tok * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_c = tl.load(c + tok)
    if RET == 1:
        b_r = tl.load(r + tok).to(tl.float32) + tl.zeros([BK], tl.float32)
    elif RET == 2:
        b_r = tl.load(r + tok * K + o_k, mask=m_k, other=1.0).to(tl.float32)
    else:
        b_r = tl.full([BK], 1.0, tl.float32)
    return b_k, b_c, b_r


@triton.jit
def picard_summary_kernel(
    k, r, c, scalars, cu_seqlens, summ,
    T, NC, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    RET: tl.constexpr, BOX: tl.constexpr, VARLEN: tl.constexpr,
):
    """``summ[nh, j] = (a, b, lo, hi)``: the composition of chunk ``j``'s maps. With the step sizes
    given, the maps act on each channel alone: every thread composes its channels token by token,
    with no exchange between threads."""
    i_j, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = _bounds(cu_seqlens, i_n, T, VARLEN)
    t0 = bos + i_j * BT
    if t0 < eos:
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        d_min, d_max = _box(scalars, BOX)
        a = tl.full([BK], 1.0, tl.float32)
        b = tl.zeros([BK], tl.float32)
        lo = tl.full([BK], -float("inf"), tl.float32)
        hi = tl.full([BK], float("inf"), tl.float32)
        for t in range(t0, tl.minimum(t0 + BT, eos)):
            b_k, b_c, b_r = _token(k, r, c, t * H + i_h, o_k, m_k, K, BK, RET)
            a, b, lo, hi = _compose(a, b, lo, hi, b_r, b_c * (b_k * b_k), d_min, d_max)
        base = summ + (i_nh.to(tl.int64) * NC + i_j) * 4 * K
        tl.store(base + 0 * K + o_k, a, mask=m_k)
        tl.store(base + 1 * K + o_k, b, mask=m_k)
        tl.store(base + 2 * K + o_k, lo, mask=m_k)
        tl.store(base + 3 * K + o_k, hi, mask=m_k)


@triton.jit
def picard_carry_kernel(
    d0, cu_seqlens, summ, d_in, dfin,
    T, NC, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    D0: tl.constexpr, VARLEN: tl.constexpr,
):
    """``d_in[nh, j]``: the d entering chunk ``j`` (chunk maps applied in order from ``d_0``)."""
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = _bounds(cu_seqlens, i_n, T, VARLEN)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_d = _load_d0(d0, i_nh, i_h, o_k, m_k, K, BK, D0)
    n_chunks = (eos - bos + BT - 1) // BT
    for j in range(0, n_chunks):
        at = (i_nh.to(tl.int64) * NC + j) * K
        tl.store(d_in + at + o_k, b_d, mask=m_k)
        base = summ + at * 4
        a = tl.load(base + 0 * K + o_k, mask=m_k, other=1.0)
        b = tl.load(base + 1 * K + o_k, mask=m_k, other=0.0)
        lo = tl.load(base + 2 * K + o_k, mask=m_k, other=0.0)
        hi = tl.load(base + 3 * K + o_k, mask=m_k, other=0.0)
        b_d = tl.minimum(tl.maximum(a * b_d + b, lo), hi)
    tl.store(dfin + i_nh * K + o_k, b_d, mask=m_k)


@triton.jit
def picard_rescan_kernel(
    k, beta, r, d0, scalars, cu_seqlens, c, d_in,
    c_new, err, wk, dt,
    T, NC, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    RET: tl.constexpr, D0: tl.constexpr, BOX: tl.constexpr, BETA_AWARE: tl.constexpr,
    STORE_D: tl.constexpr, VARLEN: tl.constexpr, FIRST: tl.constexpr,
):
    """Chunk ``j``'s trajectory from ``d_in[nh, j]`` under the step sizes ``c``: writes ``k̃``, ``D``
    (``STORE_D``), the next step sizes ``c_new`` and ``err[nh, j]`` (> 0: some ``c_t`` still moved).
    The d update uses the given ``c_t``, so the new step size's reduction ``⟨D_t, s_t⟩`` is off the
    token-to-token chain. ``FIRST``: the first guess, every ``D_t = d_0`` (only ``c_new`` written)."""
    i_j, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = _bounds(cu_seqlens, i_n, T, VARLEN)
    t0 = bos + i_j * BT
    if t0 < eos:
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        eta = tl.load(scalars + 0)
        eps = tl.load(scalars + 1)
        tol = tl.load(scalars + 4)
        d_min, d_max = _box(scalars, BOX)
        if FIRST:
            b_d = _load_d0(d0, i_nh, i_h, o_k, m_k, K, BK, D0)
        else:
            b_d = tl.load(d_in + (i_nh.to(tl.int64) * NC + i_j) * K + o_k, mask=m_k, other=1.0)
        moved = tl.sum(tl.zeros([BK], tl.float32), axis=0) - float("inf")  # an fp32 scalar
        for t in range(t0, tl.minimum(t0 + BT, eos)):
            tok = t * H + i_h
            b_k, b_c, b_r = _token(k, r, c, tok, o_k, m_k, K, BK, RET)
            b_s = b_k * b_k
            if BETA_AWARE:
                p = tl.load(beta + tok).to(tl.float32)
            else:
                p = 1.0
            alpha = eta * p / tl.maximum(tl.sum(b_s, axis=0), eps)
            c_next = alpha - alpha * p * tl.sum(b_d * b_s, axis=0)
            tl.store(c_new + tok, c_next)
            if not FIRST:
                # Algorithm 1: the write key uses d_t, before the update.
                tl.store(wk + tok * K + o_k, (b_d * b_k).to(wk.dtype.element_ty), mask=m_k)
                if STORE_D:
                    tl.store(dt + tok * K + o_k, b_d, mask=m_k)
                moved = tl.maximum(moved, tl.abs(c_next - b_c) - tol * (1.0 + tl.abs(b_c)))
                b_d = b_r * b_d + b_c * b_s
                if BOX:
                    b_d = tl.minimum(tl.maximum(b_d, d_min), d_max)
        if not FIRST:
            tl.store(err + i_nh * NC + i_j, moved)


def parallel_fwd(k, beta, retention, d0, cu_seqlens, N, eta, d_min, d_max, beta_aware, eps, store_d,
                 chunk: int = 64, max_rounds: int = 32, stats: dict | None = None):
    """Phase 1's forward by Picard rounds over whole sequences; returns ``(write_key, d trajectory or
    None, d_final)`` like :func:`osdn_diag.ops.phase1.phase1_fwd` (``d`` and ``d_final`` fp32).
    Falls back to the sequential kernel when ``max_rounds`` do not converge. ``stats``, if given,
    receives ``rounds`` and ``converged``."""
    B, T, H, K = k.shape
    if k.dtype == torch.float64:
        raise ValueError("argument 'k': the token-parallel kernel computes in fp32; fp64 keys need 'sequential'")
    if K > MAX_K:
        raise ValueError(f"argument 'k': K <= {MAX_K} supported, got {K}")
    k, beta, retention, d0 = map(_contig, (k, beta, retention, d0))
    dev = k.device
    longest = T if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if N else 0
    NC = max(1, triton.cdiv(longest, chunk))
    wk = torch.empty_like(k)
    dt = torch.empty(B, T, H, K, dtype=torch.float32, device=dev) if store_d else None
    dfin = torch.empty(N, H, K, dtype=torch.float32, device=dev)
    c = torch.empty(B, T, H, dtype=torch.float32, device=dev)
    c_next = torch.empty_like(c)
    summ = torch.empty(N * H, NC, 4, K, dtype=torch.float32, device=dev)
    d_in = torch.empty(N * H, NC, K, dtype=torch.float32, device=dev)
    err = torch.empty(N * H, NC, dtype=torch.float32, device=dev)
    tol = torch.full((1,), 8 * torch.finfo(torch.float32).eps, dtype=torch.float32, device=dev)
    scalars = torch.cat([_params(eta, eps, d_min, d_max, dtype=torch.float32, device=dev), tol])
    dummy = scalars[:1]
    r_arg = dummy if retention is None else retention
    d0_arg = dummy if d0 is None else d0
    cu_arg = dummy if cu_seqlens is None else cu_seqlens
    consts = dict(H=H, K=K, BK=triton.next_power_of_2(K), BT=chunk)
    flags = dict(VARLEN=cu_seqlens is not None)
    box = d_min is not None
    grid = (NC, N * H)

    def rescan(c_in, first):
        err.fill_(-float("inf"))
        picard_rescan_kernel[grid](
            k, beta, r_arg, d0_arg, scalars, cu_arg, c_in, d_in, c_next, err, wk,
            dummy if dt is None else dt, T, NC, **consts,
            RET=_ret_mode(retention), D0=_d0_mode(d0), BOX=box, BETA_AWARE=bool(beta_aware),
            STORE_D=store_d, FIRST=first, **flags, num_warps=1,
        )

    rescan(c, True)  # c_next ← the first guess
    stats = {} if stats is None else stats
    for stats["rounds"] in range(1, max_rounds + 1):
        c, c_next = c_next, c
        picard_summary_kernel[grid](k, r_arg, c, scalars, cu_arg, summ, T, NC, **consts,
                                    RET=_ret_mode(retention), BOX=box, **flags, num_warps=1)
        picard_carry_kernel[(N * H,)](d0_arg, cu_arg, summ, d_in, dfin, T, NC, **consts,
                                      D0=_d0_mode(d0), **flags, num_warps=1)
        rescan(c, False)
        if not bool((err > 0).any()):
            stats["converged"] = True
            return wk, dt, dfin
    stats["converged"] = False
    return phase1_fwd(k, beta, retention, d0, cu_seqlens, N, eta, d_min, d_max, beta_aware, eps, store_d)
