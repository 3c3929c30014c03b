"""OSDN phase 2: the asymmetric chunked delta rule (read key ``k``, write key ``k̃ = d ⊙ k``), forward and
backward, composed from flash-linear-attention 0.6.0's own chunk building blocks — no new state kernel.

The reference is :func:`osdn_diag.math.recurrence.delta_rule_recurrence` with ``write_key=`` (and ``g=``
for OSGDN). Per (sequence, head) and token ``t``, in the ``V×K`` convention::

    S̄_{t−1} = exp(g_t) S_{t−1}                      (no decay when g is None)
    S_t     = S̄_{t−1} + β_t (v_t − S̄_{t−1} k_t) k̃_tᵀ
    o_t     = S_t (scale · q_t)

**Where the pieces come from.** fla 0.6.0's ``fla/ops/precond_gated_delta_rule/chunk.py`` is already this
computation with a write key (``k_precond``) that it builds itself (ATK preconditioner, ``chunk_atk_fwd``)
before the chunk kernels. Every chunk building block it calls takes the write key as a plain tensor
argument, so we call the same blocks with OSDN's write key (phase 1's output) and skip the ATK part:

forward (``g_c = chunk_local_cumsum(g, 64, scale=1/ln 2)`` when gated — fla's kernels use ``exp2``)::

    A       = chunk_precond_kkt_fwd(k=k, k_precond=k̃, g=g_c or zeros, beta, output_dtype=fp32)
              # A_ij = β_i ⟨k_i, k̃_j⟩ exp(g_i − g_j), i > j within a 64-chunk (read key rows, write key cols)
    A       = solve_tril(A, output_dtype=k.dtype)                 # (I + A)^{-1}
    w, u    = recompute_w_u_fwd(k=k, v, beta, A, g=g_c)           # w = A·(β e^g k) (read key), u = A·(β v)
    h, v_new, ht = chunk_gated_delta_rule_fwd_h(k=k̃, w, u, g=g_c, state_v_first=True)
              # chunk states; v_new = u − w h; h += k̃ᵀ-side update (write key)
    o       = chunk_fwd_o(q, k=k̃, v=v_new, h, g=g_c, scale, state_v_first=True)

backward (``w, u, h, v_new`` recomputed as above)::

    dv      = chunk_bwd_dv_local(q, k=k̃, g=g_c, do, scale)
    dh, dh0, dv = chunk_gated_delta_rule_bwd_dhu(q, k=k̃, w, g=g_c, h0, dht, do, dv, scale, state_v_first=True)
    dq, dk̃, dw, dg = chunk_bwd_dqkwg(q, k=k̃, v=v_new, w, g=g_c, h, dv, do, dh, scale, state_v_first=True)
    dk, dk̃_wy, dv, dβ, dg2 = prepare_precond_wy_repr_bwd(k=k, k_precond=k̃, v, beta, g=g_c, A, dw, du=dv)
    dk̃ += dk̃_wy;   dg = chunk_local_cumsum(dg + dg2, 64, reverse=True)

``prepare_precond_wy_repr_bwd`` is the piece that makes the asymmetric form trainable: it returns the
read-key (row side of A) and write-key (column side) gradients separately.

**Ungated case.** ``g=None`` everywhere except ``chunk_precond_kkt_fwd``, whose kernel loads ``g``
unconditionally (no ``USE_G`` switch; a ``None`` pointer would fail), so it gets a zero tensor. All other
blocks switch their gate off on ``g is None``; in particular ``chunk_bwd_dqkwg`` is then called with
``g=None``, which is exactly the condition under which fla's Hopper guard (triton ≥ 3.4 and < 3.7.1,
fla #640) does **not** fire: the ungated backward is not blocked by it. The gated backward calls
``chunk_bwd_dqkwg(g=g_c)`` and is refused by that guard on such a GPU (RuntimeError, raised by fla).

**State layout.** fla's blocks take ``state_v_first``: ``True`` stores the state ``[N, H, V, K]``, which
is our ``V×K`` convention, so the API passes and returns states unchanged. The final state is fp32
(fla allocates it so).

**dtypes.** No fp32 assert on this path (unlike the public ``chunk_delta_rule``). Under Triton's
interpreter use fp32 (bf16 dots are wrong there).
"""

from __future__ import annotations

import torch

from ..runtime.checks import check_cu_seqlens, check_cu_seqlens_layout
from ..runtime.interpret import check_launchable

__all__ = ["chunk_osdn", "ChunkOSDNFunction"]

BT = 64


def _fla():
    """Import fla's building blocks lazily (importing fla before TRITON_INTERPRET is set on a CPU
    machine would build its kernels for compilation)."""
    from fla.ops.common.chunk_delta_h import (
        chunk_gated_delta_rule_bwd_dhu,
        chunk_gated_delta_rule_fwd_h,
    )
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local, chunk_fwd_o
    from fla.ops.gated_delta_rule.wy_fast import recompute_w_u_fwd
    from fla.ops.precond_gated_delta_rule.chunk_precond_kkt_fwd import chunk_precond_kkt_fwd
    from fla.ops.precond_gated_delta_rule.chunk_precond_wy_bwd import prepare_precond_wy_repr_bwd
    from fla.ops.utils import chunk_local_cumsum, solve_tril
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.index import prepare_chunk_indices

    return dict(
        chunk_gated_delta_rule_bwd_dhu=chunk_gated_delta_rule_bwd_dhu,
        chunk_gated_delta_rule_fwd_h=chunk_gated_delta_rule_fwd_h,
        chunk_bwd_dqkwg=chunk_bwd_dqkwg,
        chunk_bwd_dv_local=chunk_bwd_dv_local,
        chunk_fwd_o=chunk_fwd_o,
        recompute_w_u_fwd=recompute_w_u_fwd,
        chunk_precond_kkt_fwd=chunk_precond_kkt_fwd,
        prepare_precond_wy_repr_bwd=prepare_precond_wy_repr_bwd,
        chunk_local_cumsum=chunk_local_cumsum,
        solve_tril=solve_tril,
        RCP_LN2=RCP_LN2,
        prepare_chunk_indices=prepare_chunk_indices,
    )


def _w_u_h(f, k, wk, v, beta, A, gc, initial_state, output_final_state, cu_seqlens, chunk_indices):
    w, u = f["recompute_w_u_fwd"](
        k=k, v=v, beta=beta, A=A, g=gc, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices
    )
    h, v_new, ht = f["chunk_gated_delta_rule_fwd_h"](
        k=wk,
        w=w,
        u=u,
        g=gc,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        state_v_first=True,
    )
    return w, u, h, v_new, ht


def chunk_osdn_fwd(q, k, v, beta, wk, g, scale, initial_state, output_final_state, cu_seqlens):
    """Forward through fla's blocks. Returns ``(o, final_state, A, g_cumsum, chunk_indices)``."""
    f = _fla()
    chunk_indices = (
        f["prepare_chunk_indices"](cu_seqlens, BT) if cu_seqlens is not None else None
    )
    gc = None
    if g is not None:
        gc = f["chunk_local_cumsum"](
            g, chunk_size=BT, scale=f["RCP_LN2"], cu_seqlens=cu_seqlens, chunk_indices=chunk_indices
        )
    # chunk_precond_kkt_fwd_kernel loads g without a USE_G switch: zeros stand for "no gate".
    g_kkt = gc if gc is not None else torch.zeros_like(beta, dtype=torch.float32)
    A = f["chunk_precond_kkt_fwd"](
        k=k,
        k_precond=wk,
        g=g_kkt,
        beta=beta,
        chunk_size=BT,
        output_dtype=torch.float32,
        cu_seqlens=cu_seqlens,
    )
    A = f["solve_tril"](A=A, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, output_dtype=k.dtype)
    _, _, h, v_new, ht = _w_u_h(
        f, k, wk, v, beta, A, gc, initial_state, output_final_state, cu_seqlens, chunk_indices
    )
    o = f["chunk_fwd_o"](
        q=q,
        k=wk,
        v=v_new,
        h=h,
        g=gc,
        scale=scale,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        state_v_first=True,
    )
    return o, ht, A, gc, chunk_indices


def chunk_osdn_bwd(q, k, v, beta, wk, gc, A, scale, initial_state, do, dht, cu_seqlens, chunk_indices):
    """Backward through fla's blocks. Returns ``(dq, dk, dv, dbeta, dwk, dg, dh0)`` (``dg`` is ``None``
    when ungated, ``dh0`` when there is no initial state)."""
    f = _fla()
    w, _, h, v_new, _ = _w_u_h(
        f, k, wk, v, beta, A, gc, initial_state, False, cu_seqlens, chunk_indices
    )
    dv = f["chunk_bwd_dv_local"](
        q=q, k=wk, g=gc, do=do, scale=scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices
    )
    dh, dh0, dv = f["chunk_gated_delta_rule_bwd_dhu"](
        q=q,
        k=wk,
        w=w,
        g=gc,
        h0=initial_state,
        dht=dht,
        do=do,
        dv=dv,
        scale=scale,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        state_v_first=True,
    )
    dq, dwk, dw, dg = f["chunk_bwd_dqkwg"](
        q=q,
        k=wk,
        v=v_new,
        w=w,
        g=gc,
        h=h,
        dv=dv,
        do=do,
        dh=dh,
        scale=scale,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
        state_v_first=True,
    )
    dk, dwk_wy, dv, dbeta, dg2 = f["prepare_precond_wy_repr_bwd"](
        k=k,
        k_precond=wk,
        v=v,
        beta=beta,
        g=gc,
        A=A,
        dw=dw,
        du=dv,
        cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices,
    )
    dwk = dwk + dwk_wy
    if gc is not None:
        dg = f["chunk_local_cumsum"](
            dg + dg2, chunk_size=BT, reverse=True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices
        )
    return dq, dk, dv, dbeta, dwk, dg, dh0


class ChunkOSDNFunction(torch.autograd.Function):
    """Autograd wrapper; arguments as :func:`chunk_osdn` (all positional, contiguous)."""

    @staticmethod
    def forward(ctx, q, k, v, beta, write_key, g, scale, initial_state, output_final_state, cu_seqlens):
        o, ht, A, gc, chunk_indices = chunk_osdn_fwd(
            q, k, v, beta, write_key, g, scale, initial_state, output_final_state, cu_seqlens
        )
        ctx.save_for_backward(q, k, v, beta, write_key, gc, A, initial_state, cu_seqlens, chunk_indices)
        ctx.scale = scale
        ctx.g_dtype = None if g is None else g.dtype
        return o.to(q.dtype), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, wk, gc, A, initial_state, cu_seqlens, chunk_indices = ctx.saved_tensors
        do = do.contiguous()
        if dht is not None:
            dht = dht.contiguous()
        dq, dk, dv, dbeta, dwk, dg, dh0 = chunk_osdn_bwd(
            q, k, v, beta, wk, gc, A, ctx.scale, initial_state, do, dht, cu_seqlens, chunk_indices
        )
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            dbeta.to(beta.dtype),
            dwk.to(wk.dtype),
            None if dg is None else dg.to(ctx.g_dtype),
            None,
            None if dh0 is None else dh0.to(initial_state.dtype),
            None,
            None,
        )


def chunk_osdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    write_key: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """OSDN / OSGDN phase 2, chunked, differentiable in every tensor argument.

    Args:
        q, k: ``[B, T, H, K]`` queries and read keys (used as given: no l2 norm here).
        v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
        write_key: ``[B, T, H, K]`` ``k̃ = d ⊙ k`` (phase 1's output, e.g. :func:`osdn_precondition`).
        g: ``[B, T, H]`` log decay (OSGDN) or ``None`` (OSDN).
        scale: read-out scale; ``None`` means ``K ** -0.5``.
        initial_state: ``[N, H, V, K]`` (our ``V×K`` convention, = fla's ``state_v_first=True``).
        output_final_state: return the ``[N, H, V, K]`` fp32 final state (else ``None``).
        cu_seqlens: ``[N + 1]`` packed-sequence offsets ``[0, t_1, ..., T]`` (int32/int64, on the
            inputs' device, ``B == 1``).
        validate: also check that ``cu_seqlens`` runs from 0 to T without decreasing (it reads the
            offsets, so it waits for the device); ``False`` for hot loops whose offsets are known
            good. Its dtype, shape and device are checked either way: the kernels index memory
            through it unchecked.

    Returns:
        ``(o [B, T, H, V], final_state [N, H, V, K] | None)``.

    Raises ``RuntimeError`` for CPU tensors when fla's kernels cannot run under Triton's interpreter
    (:func:`osdn_diag.runtime.prepare` was not called).
    """
    if q.dim() != 4 or k.shape != q.shape or write_key.shape != k.shape:
        raise ValueError(
            f"q, k, write_key must all be [B, T, H, K]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(write_key.shape)}"
        )
    B, T, H, K = k.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}]; got {tuple(beta.shape)}")
    if g is not None and g.shape != (B, T, H):
        raise ValueError(f"g must be [B, T, H] = [{B}, {T}, {H}] (scalar log decay); got {tuple(g.shape)}")
    if K > 256:
        raise ValueError(f"K = {K}: fla's chunk state kernels support K <= 256")
    if cu_seqlens is None:
        N = B
    elif validate:
        N = len(check_cu_seqlens(cu_seqlens, B, T, k.device)) - 1
    else:
        N = check_cu_seqlens_layout(cu_seqlens, B, k.device)
    if initial_state is not None and initial_state.shape != (N, H, v.shape[-1], K):
        raise ValueError(
            f"initial_state must be [N, H, V, K] = [{N}, {H}, {v.shape[-1]}, {K}]; "
            f"got {tuple(initial_state.shape)}"
        )
    check_launchable("chunk_osdn", k.device)
    if scale is None:
        scale = K**-0.5
    c = lambda x: None if x is None else x.contiguous()  # noqa: E731
    return ChunkOSDNFunction.apply(
        c(q), c(k), c(v), c(beta), c(write_key), c(g), scale, c(initial_state),
        output_final_state, cu_seqlens,
    )
