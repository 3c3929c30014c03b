"""Comba's recurrence (fla 0.6.0's ``chunk_comba`` / ``fused_recurrent_comba``), token by token.

Comba removes along one key and writes along another, and — unlike the package's gated delta rule —
measures its residual against the state *before* the token's decay. In the ``V×K`` convention, per
head and token (``α_t = exp(g_t)``, a head scalar):

    u_t = v_t − S_{t−1} p_t                 (residual, read key p_t, pre-decay state)
    S_t = α_t S_{t−1} + β_t u_t k_tᵀ        (decay, then the write along k_t)
    o_t = S_t (scale · q_t)

This is the order of fla's Triton kernels: the fused recurrent kernel subtracts ``h·p`` from ``v``
before it multiplies ``h`` by ``exp(g)``, and the chunk kernels weight the in-chunk products with
the *exclusive* cumulative gate (``g0 = cumsum(g) − g``). fla's ``naive_recurrent_comba`` decays
first; it is not what the kernels run, and this reference follows the kernels.

The loss is the one the residual is the error of, ``f_t(S) = ½‖S p_t − v_t‖²`` (read key ``p_t``):
``loss_before = f_t(S_{t−1}) = ½‖u_t‖²``, ``loss_after = f_t(S_t)``, and for a gated call
``loss_before_decayed = f_t(α_t S_{t−1})``. The write is a step along ``−u_t k_tᵀ``, a descent
direction of ``f_t`` where ``⟨k_t, p_t⟩ > 0``. Without decay, one token gives exactly
``f_t(S_t) = (1 − a_t)² f_t(S_{t−1})`` with ``a_t = β_t⟨k_t, p_t⟩`` (``write_gain``).

``columns["residual_ratio_alt"]`` is the same ratio for the loss read with the write key,
``½‖S k_t − v_t‖²`` (pre-decay denominator), for comparison with the delta rules that read and
write with one key.
"""

from __future__ import annotations

import torch

from ..runtime.checks import check_cu_seqlens, check_finite, check_shape, check_tensor
from .closed_forms import residual_ratio
from .recurrence import RecurrenceResult, _apply

__all__ = ["ALT_COLUMN", "comba_recurrence"]

#: The further per-token column: the ratio of the loss read with the write key k.
ALT_COLUMN = "residual_ratio_alt"


def _scan(q, p, k, v, beta, alpha, S):
    """One segment. ``q, p, k: [B, L, H, K]``, ``v: [B, L, H, V]``, ``beta: [B, L, H]``, ``alpha``
    ``None`` or ``[B, L, H]``, ``S: [B, H, V, K]``."""
    B, L, H, _ = k.shape
    o = q.new_empty(B, L, H, v.shape[-1])
    before, after = q.new_empty(B, L, H), q.new_empty(B, L, H)
    before_dec = q.new_empty(B, L, H) if alpha is not None else None
    alt_before, alt_after = q.new_empty(B, L, H), q.new_empty(B, L, H)
    for t in range(L):
        pt, kt, vt = p[:, t], k[:, t], v[:, t]
        u = vt - _apply(S, pt)  # against the state before this token's decay
        before[:, t] = 0.5 * u.square().sum(-1)
        alt_before[:, t] = 0.5 * (_apply(S, kt) - vt).square().sum(-1)
        if alpha is not None:
            S = S * alpha[:, t, :, None, None]
            before_dec[:, t] = 0.5 * (_apply(S, pt) - vt).square().sum(-1)
        S = S + beta[:, t, :, None, None] * u[..., :, None] * kt[..., None, :]
        after[:, t] = 0.5 * (_apply(S, pt) - vt).square().sum(-1)
        alt_after[:, t] = 0.5 * (_apply(S, kt) - vt).square().sum(-1)
        o[:, t] = _apply(S, q[:, t])
    return o, S, before, before_dec, after, alt_before, alt_after


def comba_recurrence(
    q: torch.Tensor,
    p: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    dtype: torch.dtype | None = None,
    allow_nonfinite: bool = False,
) -> RecurrenceResult:
    """Comba in the ``V×K`` convention (module docstring), batched over batch rows and heads.

    Args:
        q: ``[B, T, H, K]`` queries (not yet scaled); p: ``[B, T, H, K]`` read (removal) keys;
            k: ``[B, T, H, K]`` write keys — all used as given (no normalisation).
        v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
        g: ``[B, T, H]`` log decay, or ``None`` (no decay).
        scale: multiplies ``q``; ``None`` means ``K ** -0.5``.
        initial_state: ``[N, H, V, K]`` (zeros when ``None``); cu_seqlens: ``[N + 1]`` (``B == 1``).
        dtype: compute dtype (default fp64 if any input is fp64, else fp32).
        allow_nonfinite: let NaN/Inf propagate as a kernel would, instead of refusing them.

    Returns:
        :class:`RecurrenceResult` with ``final_state [N, H, V, K]``, ``write_gain = β⟨k, p⟩`` and
        ``columns = {"residual_ratio_alt": ...}``.
    """
    named = {"q": q, "p": p, "k": k, "v": v, "beta": beta}
    for name, x in named.items():
        check_tensor(name, x)
    if k.dim() != 4:
        check_shape("k", k, [None] * 4, "[B, T, H, K]")
    B, T, H, K = k.shape
    check_shape("q", q, [B, T, H, K], "[B, T, H, K]")
    check_shape("p", p, [B, T, H, K], "[B, T, H, K]")
    check_shape("v", v, [B, T, H, None], "[B, T, H, V]")
    check_shape("beta", beta, [B, T, H], "[B, T, H]")
    V = v.shape[-1]
    if g is not None:
        check_tensor("g", g)
        check_shape("g", g, [B, T, H], "[B, T, H]")
        named["g"] = g
    offsets = [0, T] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    N = B if cu_seqlens is None else len(offsets) - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
        check_shape("initial_state", initial_state, [N, H, V, K], "[N, H, V, K]")
        named["initial_state"] = initial_state
    if not allow_nonfinite:
        for name, x in named.items():
            check_finite(name, x)
    if dtype is None:
        dtype = torch.float64 if any(x.dtype == torch.float64 for x in named.values()) else torch.float32
    q, p, k, v, beta = (x.to(dtype) for x in (q, p, k, v, beta))
    q = q * (K**-0.5 if scale is None else scale)
    alpha = None if g is None else g.to(dtype).exp()
    init = q.new_zeros(N, H, V, K) if initial_state is None else initial_state.to(dtype)

    spans = [(slice(None), slice(None), slice(None))] if cu_seqlens is None else [
        (slice(0, 1), slice(s, e), slice(n, n + 1)) for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:]))
    ]
    parts = []
    for rows, span, state in spans:
        parts.append(_scan(q[rows, span], p[rows, span], k[rows, span], v[rows, span], beta[rows, span],
                           None if alpha is None else alpha[rows, span], init[state].clone()))

    def cat(i):
        return torch.cat([part[i] for part in parts], dim=1)

    o, before, after = cat(0), cat(2), cat(4)
    before_dec = None if alpha is None else cat(3)
    alt = residual_ratio(cat(6), cat(5))
    final = torch.cat([part[1] for part in parts], dim=0)
    return RecurrenceResult(
        o=o, final_state=final, loss_before=before, loss_after=after,
        write_gain=beta * (k * p).sum(-1), loss_before_decayed=before_dec, columns={ALT_COLUMN: alt},
    )
