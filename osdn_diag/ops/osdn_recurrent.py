"""OSDN / OSGDN in one fused recurrent Triton kernel: phase 1 and phase 2 token by token (inference).

The chunked path (:func:`osdn_diag.ops.phase1.osdn_precondition` then
:func:`osdn_diag.ops.osdn_chunk.chunk_osdn`) costs a dozen kernel launches whatever the length; for
decoding (one token at a time) and other short inputs this kernel does both phases in one launch, the
way fla's ``fused_recurrent_delta_rule`` serves DeltaNet. Per (sequence, head) and token ``t``::

    k̃_t = d_t ⊙ k_t                                    (phase 1 emits before it updates)
    S   ← α_t S                                        (OSGDN: α_t = exp(g_t); OSDN: α_t = 1)
    S   ← S + β_t (v_t − S k_t) k̃_tᵀ                   (the residual against the decayed state)
    o_t = S (scale · q_t)
    d_{t+1} = clamp(r_t ⊙ d_t + η p_t (1 − p_t ⟨d_t, s_t⟩) / max(‖k_t‖², ε) · s_t, d_min, d_max)

with ``s_t = k_t ⊙ k_t`` and ``p_t = β_t`` (beta-aware) or 1 — the recurrences of
:func:`osdn_diag.math.phase1.osdn_phase1` and :func:`osdn_diag.math.recurrence.delta_rule_recurrence`,
which are the references. The state ``S`` is ``V×K`` (``[N, H, V, K]``).

One program per (sequence, head, block of ``BV`` value rows) holds those rows of the state (key-major,
as a ``[K, BV]`` tile) and its own copy of ``d`` in registers (phase 1 is a ``K``-vector recurrence:
recomputing it per value block costs less than sharing it); the program of the first value block
stores ``d``. fp32 accumulation for bf16/fp16 inputs. Forward only: training takes the chunked path,
which has a backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..runtime.checks import check_box, check_cu_seqlens_layout
from ..runtime.interpret import check_launchable
from ..math.phase1 import _validate
from ._common import load_d0, sequence_bounds, step_size_terms
from .phase1_sequential import _contig, _d0_mode, _params, _ret_mode

__all__ = ["FusedRecurrentResult", "fused_recurrent_osdn", "fused_recurrent_osdn_fwd_kernel"]

MAX_K = 256


@dataclass
class FusedRecurrentResult:
    """Output of :func:`fused_recurrent_osdn`.

    Attributes:
        o: ``[B, T, H, V]`` in ``v``'s dtype.
        final_state: ``[N, H, V, K]`` fp32, or ``None`` unless ``output_final_state``.
        d_final: ``[N, H, K]`` fp32 — the preconditioner after the last token (what a cache carries).
        d: ``[B, T, H, K]`` fp32 — ``d_t``, the preconditioner used at token ``t`` — or ``None``
            unless ``return_trajectory``.
    """

    o: torch.Tensor
    final_state: torch.Tensor | None
    d_final: torch.Tensor
    d: torch.Tensor | None = None


@triton.jit
def fused_recurrent_osdn_fwd_kernel(
    q, k, v, beta, g, r, d0, h0, scalars, cu_seqlens,
    o, ht, dfin, dt,
    scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    RET: tl.constexpr,          # 0: none, 1: per (token, head) [B, T, H], 2: per channel [B, T, H, K]
    D0: tl.constexpr,           # 0: ones, 1: shared [H, K], 2: per sequence [N, H, K]
    USE_G: tl.constexpr, USE_H0: tl.constexpr, STORE_FINAL: tl.constexpr, BOX: tl.constexpr,
    BETA_AWARE: tl.constexpr, STORE_D: tl.constexpr, VARLEN: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = sequence_bounds(cu_seqlens, i_n, T, VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    # Scalars arrive as an fp32 tensor: a Python float argument would be specialised per value.
    eta = tl.load(scalars + 0)
    eps = tl.load(scalars + 1)
    d_min = tl.load(scalars + 2)
    d_max = tl.load(scalars + 3)
    # Only the first value block stores d. (Built as a comparison, not `m_k & (i_v == 0)`: the
    # interpreter mis-types a block-and-scalar mask.)
    m_kd = o_k < tl.where(i_v == 0, K, 0)

    b_d = load_d0(d0, i_nh, i_h, o_k, m_k, K, BK, D0, tl.float32)
    # The state is held key-major, [K, BV]: Triton compiles its K-reductions with far fewer warp
    # shuffles than for [BV, K] (osdn_diag.ops.replay counts them).
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_S += tl.load(h0 + (i_nh * V + o_v[None, :]) * K + o_k[:, None], mask=m_kv, other=0.0).to(tl.float32)

    for t in range(bos, eos):
        tok = t * H + i_h
        b_k = tl.load(k + tok * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_q = tl.load(q + tok * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_v = tl.load(v + tok * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + tok).to(tl.float32)
        if STORE_D:
            tl.store(dt + tok * K + o_k, b_d, mask=m_kd)
        # Phase 2 with the write key of d_t.
        if USE_G:
            b_S = b_S * tl.exp(tl.load(g + tok).to(tl.float32))
        b_res = b_v - tl.sum(b_S * b_k[:, None], axis=0)
        b_S += (b_d * b_k)[:, None] * (b_beta * b_res)[None, :]
        b_o = tl.sum(b_S * b_q[:, None], axis=0)
        tl.store(o + tok * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
        # Phase 1: d_t -> d_{t+1} (the same arithmetic as osdn_diag.ops.phase1's sweep).
        b_s = b_k * b_k
        alpha, gam = step_size_terms(b_s, b_beta, eta, eps, BETA_AWARE)
        c = alpha - gam * tl.sum(b_d * b_s, axis=0)
        if RET == 1:
            b_d = tl.load(r + tok).to(tl.float32) * b_d + c * b_s
        elif RET == 2:
            b_d = tl.load(r + tok * K + o_k, mask=m_k, other=1.0).to(tl.float32) * b_d + c * b_s
        else:
            b_d = b_d + c * b_s
        if BOX:
            b_d = tl.minimum(tl.maximum(b_d, d_min), d_max)

    tl.store(dfin + i_nh * K + o_k, b_d, mask=m_kd)
    if STORE_FINAL:
        tl.store(ht + (i_nh * V + o_v[None, :]) * K + o_k[:, None], b_S, mask=m_kv)


def fused_recurrent_osdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    retention: torch.Tensor | None = None,
    d0: torch.Tensor | None = None,
    eta: float = 0.003,
    d_min: float | None = 0.5,
    d_max: float | None = 2.0,
    beta_aware: bool = True,
    eps: float = 1e-6,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    return_trajectory: bool = False,
    validate: bool = True,
) -> FusedRecurrentResult:
    """OSDN (``g=None``) or OSGDN, both phases in one recurrent kernel; forward only.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys as the state reads them (normalised by the caller).
        v: ``[B, T, H, V]``; beta: ``[B, T, H]``; g: ``[B, T, H]`` log decay or ``None``.
        retention, d0, eta, d_min, d_max, beta_aware, eps: phase 1's, as
            :func:`osdn_diag.math.phase1.osdn_phase1`.
        scale: read-out scale (``None``: ``K ** -0.5``).
        initial_state: ``[N, H, V, K]``; output_final_state: also return the final state.
        cu_seqlens: ``[N + 1]`` packed-sequence offsets (``B == 1``).
        return_trajectory: also return ``d_t`` for every token.
        validate: run phase 1's argument checks (they synchronise with the device); ``False``
            still checks ``cu_seqlens``' dtype, shape and device, not its values.

    Returns a :class:`FusedRecurrentResult`. Raises ``RuntimeError`` when a gradient is required
    (use the chunked path, ``osdn_precondition`` + ``chunk_osdn``, to train), and for CPU tensors
    when the kernel was not built for Triton's interpreter.
    """
    if torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, beta, g, retention, d0, initial_state)
    ):
        raise RuntimeError(
            "fused_recurrent_osdn has no backward; train with the chunked path "
            "(osdn_precondition + chunk_osdn), or call this under torch.no_grad()"
        )
    B, T, H, K = k.shape
    V = v.shape[-1]
    if validate:
        _validate(k, beta, retention, d0, eta, d_min, d_max, eps, cu_seqlens, device=k.device)
        if q.shape != k.shape or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, H, V]; got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        if g is not None and g.shape != beta.shape:
            raise ValueError(f"argument 'g': expected shape {tuple(beta.shape)}, got {tuple(g.shape)}")
        if K > MAX_K:
            raise ValueError(f"argument 'k': K <= {MAX_K} supported, got {K}")
    else:
        if d_min is not None:
            check_box(d_min, d_max)
        if cu_seqlens is not None:
            # Not its values (that would wait for the device), but what the kernel's pointer needs.
            check_cu_seqlens_layout(cu_seqlens, B, k.device)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, V, K):
        raise ValueError(f"argument 'initial_state': expected shape {(N, H, V, K)}, got {tuple(initial_state.shape)}")
    check_launchable("fused_recurrent_osdn", k.device, fused_recurrent_osdn_fwd_kernel)
    scale = K ** -0.5 if scale is None else float(scale)
    dev = k.device
    q, k, v, beta, g, retention, d0, initial_state = map(_contig, (q, k, v, beta, g, retention, d0, initial_state))
    o = torch.empty_like(v)
    ht = torch.empty(N, H, V, K, dtype=torch.float32, device=dev) if output_final_state else None
    dfin = torch.empty(N, H, K, dtype=torch.float32, device=dev)
    dt = torch.empty(B, T, H, K, dtype=torch.float32, device=dev) if return_trajectory else None
    scalars = _params(eta, eps, d_min, d_max, dtype=torch.float32, device=dev)
    dummy = scalars[:1]
    BK = triton.next_power_of_2(K)
    # 8 state rows × 1 warp per program, as in the replay kernel: on the H200 (B=8, T=4096, H=8,
    # K=V=128, bf16) 5.50 ms, against 13.49 ms for the earlier 32 rows of a [BV, K] tile; decoding one
    # token for 64 sequences takes the same 0.17 ms either way. On CPU tensors the kernel runs under
    # Triton's interpreter, where every program costs Python time: fewer, wider ones there.
    BV = min(triton.next_power_of_2(V), 8 if q.is_cuda else 32)
    fused_recurrent_osdn_fwd_kernel[(N * H, triton.cdiv(V, BV))](
        q, k, v, beta,
        dummy if g is None else g,
        dummy if retention is None else retention,
        dummy if d0 is None else d0,
        dummy if initial_state is None else initial_state,
        scalars,
        dummy if cu_seqlens is None else cu_seqlens,
        o, dummy if ht is None else ht, dfin, dummy if dt is None else dt,
        scale, T,
        H=H, K=K, V=V, BK=BK, BV=BV,
        RET=_ret_mode(retention), D0=_d0_mode(d0),
        USE_G=g is not None, USE_H0=initial_state is not None, STORE_FINAL=output_final_state,
        BOX=d_min is not None, BETA_AWARE=bool(beta_aware), STORE_D=return_trajectory,
        VARLEN=cu_seqlens is not None,
        num_warps=1,
    )
    return FusedRecurrentResult(o=o, final_state=ht, d_final=dfin, d=dt)
