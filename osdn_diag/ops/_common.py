"""Triton pieces the per-(sequence, head) kernels of :mod:`osdn_diag.ops` share."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sequence_bounds(cu_seqlens, i_n, T, VARLEN: tl.constexpr):
    """``(bos, eos)``, int64 token offsets of sequence ``i_n``: from fla's ``cu_seqlens`` for packed
    variable-length input, else ``[i_n·T, (i_n+1)·T)``."""
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def load_d0(d0, i_nh, i_h, o_k, m_k, K: tl.constexpr, BK: tl.constexpr, D0: tl.constexpr, ACC: tl.constexpr):
    """The initial preconditioner of (sequence, head) ``i_nh`` in ``ACC`` over lanes ``o_k``: ones
    (``D0 = 0``), shared per head ``[H, K]`` (1) or per sequence ``[N, H, K]`` (2)."""
    if D0 == 1:
        b_d = tl.load(d0 + i_h * K + o_k, mask=m_k, other=1.0).to(ACC)
    elif D0 == 2:
        b_d = tl.load(d0 + i_nh * K + o_k, mask=m_k, other=1.0).to(ACC)
    else:
        b_d = tl.full([BK], 1.0, dtype=ACC)
    return b_d


@triton.jit
def step_size_terms(b_s, b_beta, eta, eps, BETA_AWARE: tl.constexpr):
    """``(α, γ)`` of one token's phase-1 step size ``c = α − γ ⟨d, s⟩`` (Eq. 7): ``α = η p / max(‖k‖², ε)``
    and ``γ = α p``, with ``p = β`` (beta-aware) or 1 and ``s = k ⊙ k``. Both depend on the token
    alone, which keeps the division off the chain that runs through ``d``."""
    if BETA_AWARE:
        p = b_beta
    else:
        p = 1.0
    alpha = eta * p / tl.maximum(tl.sum(b_s, axis=0), eps)
    return alpha, alpha * p
