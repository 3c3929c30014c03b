"""RWKV-7's generalised delta rule (fla's ``RWKV7Attention``), token by token, with per-token losses.

In the package's ``V×K`` convention, per head and token t (fla keeps ``hᵀ = S``, ``K×V``):

    S_t = S_{t−1} (Diag(exp(w_t)) + a_t b_tᵀ) + v_t k_tᵀ,     o_t = S_t (scale · r_t)

with a per-channel log decay ``w_t``, and, as fla's layer passes them, ``a_t = −κ̂_t`` (the removal
key: the l2-normalised ``k ⊙ k_k``) and ``b_t = κ̂_t ⊙ α_t`` (α_t ∈ (0, 1)ᴷ the in-context learning
rate), so the erase ``−(S_{t−1}κ̂_t)(κ̂_t ⊙ α_t)ᵀ`` removes the pre-decay state's prediction along
κ̂_t, and the add ``v_t k_tᵀ`` writes along a different key, the write key ``k_t``.

Inputs ``[B, T, H, ·]``: ``r`` (queries), ``removal_key`` (κ̂ = −a), ``b``, ``write_key`` (k), ``v``,
``w`` (log decay, ``[B, T, H, K]``). Two token-local losses ``½‖S x − v_t‖²``: on the removal key
(``x = κ̂_t``, the main loss: ``loss_before``, ``loss_before_decayed``, ``loss_after``) and on the write
key (``x = k_t``: ``columns["loss_before_alt"]``, ``columns["loss_after_alt"]``).

**The update's own target.** Along κ̂ the update gives
``S_tκ̂ = S_{t−1}D_tκ̂ − c_b S_{t−1}κ̂ + c_k v_t`` with ``c_b = ⟨b_t, κ̂_t⟩``, ``c_k = ⟨k_t, κ̂_t⟩``;
without decay ``S_tκ̂ − y = (1 − c_b)(S_{t−1}κ̂ − y)`` exactly when ``c_b y = c_k v_t``, so the update
drives the prediction toward ``y_t = (c_k / c_b) v_t``, not toward ``v_t`` (the two agree only when
``c_k = c_b``). ``columns["target_scale"]`` is ``c_k / c_b``; ``loss_before_own``,
``loss_before_own_decayed``, ``loss_after_own`` are ``½‖S κ̂_t − y_t‖²`` at ``S_{t−1}``, ``S_{t−1}D_t``
and ``S_t`` (NaN where ``c_b = 0``).
"""

from __future__ import annotations

import torch

from ..runtime.checks import check_cu_seqlens, check_finite, check_shape, check_tensor
from .recurrence import RecurrenceResult

__all__ = ["rwkv7_recurrence", "target_scale"]


def _apply(S: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # A batched matmul per (row, head), so a row's rounding does not depend on the other rows.
    return torch.matmul(S, x[..., None])[..., 0]


def _loss(S, x, v):
    return 0.5 * (_apply(S, x) - v).square().sum(-1)


def target_scale(removal_key: torch.Tensor, b: torch.Tensor, write_key: torch.Tensor) -> torch.Tensor:
    """``c_k / c_b`` (``[..., K]`` inputs → ``[...]``), with ``c_k = ⟨k, κ̂⟩`` and ``c_b = ⟨b, κ̂⟩``: the
    own target of the update along κ̂ is ``(c_k / c_b) v`` (module docstring). NaN where ``c_b = 0``
    (nothing is erased, so the update has no fixed point along κ̂)."""
    c_k = (write_key * removal_key).sum(-1)
    c_b = (b * removal_key).sum(-1)
    return torch.where(c_b != 0, c_k / torch.where(c_b != 0, c_b, 1.0), torch.full_like(c_b, float("nan")))


def _scan(r, kh, b, k, v, decay, S, scale_t):
    B, L, H, _ = k.shape
    o = r.new_empty(B, L, H, v.shape[-1])
    names = ("before", "before_dec", "after", "before_alt", "after_alt", "before_own", "before_own_dec", "after_own")
    out = {n: r.new_empty(B, L, H) for n in names}
    for t in range(L):
        kt, vt, xt = kh[:, t], v[:, t], k[:, t]
        yt = scale_t[:, t, :, None] * vt  # the update's own target along κ̂
        out["before"][:, t] = _loss(S, kt, vt)
        out["before_alt"][:, t] = _loss(S, xt, vt)
        out["before_own"][:, t] = _loss(S, kt, yt)
        S_dec = S * decay[:, t, :, None, :]
        out["before_dec"][:, t] = _loss(S_dec, kt, vt)
        out["before_own_dec"][:, t] = _loss(S_dec, kt, yt)
        # The erase reads the state before the decay: S a bᵀ with a = −κ̂.
        S = S_dec - _apply(S, kt)[..., :, None] * b[:, t, :, None, :] + vt[..., :, None] * xt[..., None, :]
        out["after"][:, t] = _loss(S, kt, vt)
        out["after_alt"][:, t] = _loss(S, xt, vt)
        out["after_own"][:, t] = _loss(S, kt, yt)
        o[:, t] = _apply(S, r[:, t])
    return o, S, out


def rwkv7_recurrence(
    r: torch.Tensor,
    removal_key: torch.Tensor,
    b: torch.Tensor,
    write_key: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    *,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    dtype: torch.dtype | None = None,
    allow_nonfinite: bool = False,
) -> RecurrenceResult:
    """The generalised delta rule above, looped over time, batched over rows and heads.

    Args:
        r, removal_key, b, write_key, w: ``[B, T, H, K]`` (``removal_key`` is ``−a`` of the kernel).
        v: ``[B, T, H, V]``.
        scale: multiplies r in the read-out (fla's RWKV-7 layer passes 1).
        initial_state: ``[N, H, V, K]``, zeros when ``None``.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (``B == 1``).
        dtype: compute dtype; default fp64 if any input is fp64, else fp32.
        allow_nonfinite: let NaN/Inf propagate as a kernel would, instead of refusing them.

    Returns:
        :class:`RecurrenceResult` with ``final_state [N, H, V, K]``, the removal-key losses,
        ``write_gain = ⟨b_t, κ̂_t⟩`` (the erase's gain along κ̂), and ``columns`` ``loss_before_alt``,
        ``loss_after_alt`` (the write-key losses), ``target_scale`` and the own-target losses
        ``loss_before_own``, ``loss_before_own_decayed``, ``loss_after_own`` (module docstring).
    """
    named = (("r", r), ("removal_key", removal_key), ("b", b), ("write_key", write_key), ("v", v), ("w", w))
    for name, x in named:
        check_tensor(name, x)
    if removal_key.dim() != 4:
        check_shape("removal_key", removal_key, [None] * 4, "[B, T, H, K]")
    B, T, H, K = removal_key.shape
    V = v.shape[-1]
    for name, x in (("r", r), ("b", b), ("write_key", write_key), ("w", w)):
        check_shape(name, x, [B, T, H, K], "[B, T, H, K]")
    check_shape("v", v, [B, T, H, None], "[B, T, H, V]")
    offsets = [0, T] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    N = B if cu_seqlens is None else len(offsets) - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
        check_shape("initial_state", initial_state, [N, H, V, K], "[N, H, V, K]")
    if not allow_nonfinite:
        for name, x in (*named, ("initial_state", initial_state)):
            if x is not None:
                check_finite(name, x)
    cdt = dtype or (torch.float64 if any(x.dtype == torch.float64 for _, x in named) else torch.float32)
    r, kh, b, k, v, w = (x.to(cdt) for _, x in named)
    r = r * scale
    decay = w.exp()
    S0 = r.new_zeros(N, H, V, K) if initial_state is None else initial_state.to(cdt)
    if cu_seqlens is None:
        segs = [(slice(None), S0.clone())]
    else:
        segs = [(slice(s, e), S0[n : n + 1].clone()) for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:]))]
    scale_t = target_scale(kh, b, k)
    parts = [_scan(r[:, sl], kh[:, sl], b[:, sl], k[:, sl], v[:, sl], decay[:, sl], S, scale_t[:, sl]) for sl, S in segs]
    cat = lambda name: torch.cat([p[2][name] for p in parts], dim=1)  # noqa: E731
    return RecurrenceResult(
        o=torch.cat([p[0] for p in parts], dim=1),
        final_state=torch.cat([p[1] for p in parts], dim=0),
        loss_before=cat("before"),
        loss_after=cat("after"),
        write_gain=(b * kh).sum(-1),
        loss_before_decayed=cat("before_dec"),
        columns={"loss_before_alt": cat("before_alt"), "loss_after_alt": cat("after_alt"),
                 "loss_before_own": cat("before_own"), "loss_before_own_decayed": cat("before_own_dec"),
                 "loss_after_own": cat("after_own"), "target_scale": scale_t},
    )
