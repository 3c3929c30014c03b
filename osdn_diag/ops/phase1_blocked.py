"""OSDN phase 1 as a blocked Triton kernel (forward): a clamped-affine scan per block of tokens.

The algorithm and its proof of exactness are :mod:`osdn_diag.math.phase1_blocked`, which this kernel
follows step for step; the sequential kernel it may replace is :mod:`osdn_diag.ops.phase1`. One
program per (sequence, head) walks the sequence in blocks of ``BT`` tokens. Per block:

* load the block's keys, β and retention as ``[BT, K]`` tiles, twice: at tokens ``t`` (for
  ``s_t = k_t ⊙ k_t``, ``α_t``, ``γ_t``) and at tokens ``t − 1`` (row ``t`` of the scan holds the map
  of token ``t − 1``, so that the inclusive scan yields ``d_t``, the d *used at* token ``t``; row 0 holds
  the identity);
* first guess ``c_t = α_t − γ_t ⟨d, s_t⟩`` with ``d`` frozen at the block's start; then rounds of:
  shift ``c`` down one row (a ``BT × BT`` select, the only cross-row move), scan the maps
  ``x ↦ clamp(r x + c s, d_min, d_max)`` with ``tl.associative_scan``, apply them to ``d``, and
  recompute ``c`` from the ``d_t`` rows — until ``c`` stops changing (one round at the paper's
  setting in fp32, a few at large η);
* emit ``k̃_t = d_t ⊙ k_t`` (and ``d_t``), and carry ``d`` past the block's last token.

The sequential chain is now one round per block instead of one K-wide reduction per token. fp32
accumulation (bf16/fp16/fp32 inputs); forward only (the backward of :mod:`osdn_diag.ops.phase1` needs
just the trajectory this kernel can store).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..math.phase1 import Phase1Result, _validate
from .phase1 import _contig, _d0_mode, _params, _ret_mode

__all__ = ["blocked_fwd", "osdn_precondition_blocked"]

MAX_K = 256


@triton.jit
def _compose(a1, b1, lo1, hi1, a2, b2, lo2, hi2):
    """(a2, b2, lo2, hi2) ∘ (a1, b1, lo1, hi1) for x ↦ min(max(a x + b, lo), hi), a ≥ 0. A map with
    a = 0 forgets its input — bounds included, which may be infinite (no box): 0 · inf must not
    become nan."""
    lo = tl.minimum(tl.maximum(a2 * tl.where(a2 == 0, 0.0, lo1) + b2, lo2), hi2)
    hi = tl.minimum(tl.maximum(a2 * tl.where(a2 == 0, 0.0, hi1) + b2, lo2), hi2)
    return a2 * a1, a2 * b1 + b2, lo, hi


@triton.jit
def osdn_phase1_blocked_fwd_kernel(
    k, beta, r, d0, scalars, cu_seqlens,
    wk, dt, dfin,
    T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    RET: tl.constexpr, D0: tl.constexpr, BOX: tl.constexpr, BETA_AWARE: tl.constexpr,
    STORE_D: tl.constexpr, VARLEN: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    eta = tl.load(scalars + 0)
    eps = tl.load(scalars + 1)
    if BOX:
        d_min = tl.load(scalars + 2)
        d_max = tl.load(scalars + 3)
    else:
        d_min = -float("inf")
        d_max = float("inf")
    tol = tl.load(scalars + 4)

    o_k = tl.arange(0, BK)
    o_t = tl.arange(0, BT)
    m_k = o_k < K
    if D0 == 1:
        b_d = tl.load(d0 + i_h * K + o_k, mask=m_k, other=1.0).to(tl.float32)
    elif D0 == 2:
        b_d = tl.load(d0 + i_nh * K + o_k, mask=m_k, other=1.0).to(tl.float32)
    else:
        b_d = tl.full([BK], 1.0, dtype=tl.float32)
    # shift[t, j] = 1 where j = t − 1: moves a [BT] vector down one row (row 0 gets 0).
    shift = (o_t[:, None] == o_t[None, :] + 1).to(tl.float32)

    for t0 in range(bos, eos, BT):
        rows = t0 + o_t
        m_t = rows < eos
        m_tk = m_t[:, None] & m_k[None, :]
        m_p = (o_t >= 1) & (rows - 1 < eos)           # row t holds the map of token t − 1
        m_pk = m_p[:, None] & m_k[None, :]
        tok = rows * H + i_h
        ptok = (rows - 1) * H + i_h
        b_k = tl.load(k + tok[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_s = b_k * b_k
        b_beta = tl.load(beta + tok, mask=m_t, other=0.0).to(tl.float32)
        b_kp = tl.load(k + ptok[:, None] * K + o_k[None, :], mask=m_pk, other=0.0).to(tl.float32)
        b_sp = b_kp * b_kp
        if BETA_AWARE:
            p = b_beta
        else:
            p = tl.where(m_t, 1.0, 0.0)
        alpha = eta * p / tl.maximum(tl.sum(b_s, axis=1), eps)
        gam = alpha * p
        # The maps' slopes (retention of token t − 1), identity on row 0 and past the end.
        if RET == 1:
            b_a = tl.load(r + ptok, mask=m_p, other=1.0).to(tl.float32)[:, None] + tl.zeros([BT, BK], tl.float32)
        elif RET == 2:
            b_a = tl.load(r + ptok[:, None] * K + o_k[None, :], mask=m_pk, other=1.0).to(tl.float32)
        else:
            b_a = tl.full([BT, BK], 1.0, tl.float32)
        b_lo = tl.where(m_pk, d_min, -float("inf"))
        b_hi = tl.where(m_pk, d_max, float("inf"))

        c = alpha - gam * tl.sum(b_s * b_d[None, :], axis=1)   # first guess: d frozen
        D = b_d[None, :] + tl.zeros([BT, BK], tl.float32)
        rounds = 0
        going = True
        while going:
            c_prev = tl.sum(shift * c[None, :], axis=1)          # c_{t−1} on row t
            b_b = c_prev[:, None] * b_sp
            sa, sb, slo, shi = tl.associative_scan((b_a, b_b, b_lo, b_hi), 0, _compose)
            D = tl.minimum(tl.maximum(sa * b_d[None, :] + sb, slo), shi)   # row t: d_t
            c_new = alpha - gam * tl.sum(D * b_s, axis=1)
            err = tl.max(tl.abs(c_new - c) - tol * (1.0 + tl.abs(c)), axis=0)
            c = c_new
            rounds += 1
            going = (err > 0) & (rounds <= BT)
        tl.store(wk + tok[:, None] * K + o_k[None, :], (D * b_k).to(wk.dtype.element_ty), mask=m_tk)
        if STORE_D:
            tl.store(dt + tok[:, None] * K + o_k[None, :], D, mask=m_tk)
        # d after the block: the last valid token's own map applied to its d.
        last = tl.minimum(eos - t0, BT) - 1
        sel = (o_t == last)[:, None]
        d_last = tl.sum(tl.where(sel, D, 0.0), axis=0)
        s_last = tl.sum(tl.where(sel, b_s, 0.0), axis=0)
        c_last = tl.sum(tl.where(o_t == last, c, 0.0), axis=0)
        if RET == 1:
            r_last = tl.load(r + (t0 + last) * H + i_h).to(tl.float32)
        elif RET == 2:
            r_last = tl.load(r + ((t0 + last) * H + i_h) * K + o_k, mask=m_k, other=1.0).to(tl.float32)
        else:
            r_last = 1.0
        b_d = tl.minimum(tl.maximum(r_last * d_last + c_last * s_last, d_min), d_max)
    tl.store(dfin + i_nh * K + o_k, b_d, mask=m_k)


def osdn_precondition_blocked(
    k: torch.Tensor,
    beta: torch.Tensor,
    *,
    retention: torch.Tensor | None = None,
    d0: torch.Tensor | None = None,
    eta: float = 0.003,
    d_min: float | None = 0.5,
    d_max: float | None = 2.0,
    beta_aware: bool = True,
    eps: float = 1e-6,
    cu_seqlens: torch.LongTensor | None = None,
    return_trajectory: bool = False,
    block: int = 64,
    validate: bool = True,
) -> torch.Tensor | Phase1Result:
    """Phase 1's forward by the blocked kernel; arguments and results as
    :func:`osdn_diag.ops.phase1.osdn_precondition` (not differentiable), plus ``block`` (tokens per
    block, a power of two ≥ 16)."""
    if validate:
        _validate(k, beta, retention, d0, eta, d_min, d_max, eps, cu_seqlens)
    if k.dtype == torch.float64:
        raise ValueError("argument 'k': the blocked kernel computes in fp32; use osdn_precondition for fp64")
    if k.shape[-1] > MAX_K:
        raise ValueError(f"argument 'k': K <= {MAX_K} supported, got {k.shape[-1]}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"argument 'block': expected a power of two >= 16, got {block}")
    N = k.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    wk, dt, dfin = blocked_fwd(k, beta, retention, d0, cu_seqlens, N, eta, d_min, d_max, beta_aware, eps,
                               store_d=return_trajectory, block=block)
    if return_trajectory:
        return Phase1Result(write_key=wk, d=dt, d_final=dfin)
    return wk


def blocked_fwd(k, beta, retention, d0, cu_seqlens, N, eta, d_min, d_max, beta_aware, eps, store_d,
                block: int = 64):
    """Launch the blocked forward kernel; returns ``(write_key, d trajectory or None, d_final)`` in
    the layout of :func:`osdn_diag.ops.phase1.phase1_fwd` (``d`` and ``d_final`` fp32)."""
    B, T, H, K = k.shape
    k, beta, retention, d0 = map(_contig, (k, beta, retention, d0))
    wk = torch.empty_like(k)
    dt = torch.empty(B, T, H, K, dtype=torch.float32, device=k.device) if store_d else None
    dfin = torch.empty(N, H, K, dtype=torch.float32, device=k.device)
    # phase 1's scalars (fp32 for these inputs) and the Picard rounds' stopping tolerance
    tol = k.new_full((1,), 8 * torch.finfo(torch.float32).eps, dtype=torch.float32)
    scalars = torch.cat([_params(eta, eps, d_min, d_max, dtype=torch.float32, device=k.device), tol])
    dummy = scalars[:1]
    osdn_phase1_blocked_fwd_kernel[(N * H,)](
        k, beta,
        dummy if retention is None else retention,
        dummy if d0 is None else d0,
        scalars,
        dummy if cu_seqlens is None else cu_seqlens,
        wk, dummy if dt is None else dt, dfin,
        T, H=H, K=K, BK=triton.next_power_of_2(K), BT=block,
        RET=_ret_mode(retention), D0=_d0_mode(d0),
        BOX=d_min is not None, BETA_AWARE=bool(beta_aware), STORE_D=store_d,
        VARLEN=cu_seqlens is not None,
        num_warps=4,
    )
    return wk, dt, dfin
