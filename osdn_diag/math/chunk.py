"""The chunkwise (WY / UT-transform) form of the asymmetric delta rule (App. A.2, Eq. 8–11; App. B.1,
Eq. 13–15), in plain torch.

Within a chunk of ``C`` tokens the per-token updates ``δ_j = β_j (v_j − S̄_{j−1} k_j)`` solve one unit
lower-triangular system::

    (I + A) δ = diag(β) (V − diag(γ) K S_0ᵀ),    A_jl = 1[l < j] β_j (γ_j / γ_l) ⟨k_j, k̃_l⟩

where ``γ_j = Π_{l ≤ j} α_l`` is the in-chunk decay (``γ ≡ 1`` without a gate). Then::

    S_C = γ_C S_0 + Σ_j (γ_C / γ_j) δ_j k̃_jᵀ
    o_i = γ_i S_0 q_i + Σ_{j ≤ i} (γ_i / γ_j) ⟨q_i, k̃_j⟩ δ_j

With ``W = M (γ ⊙ K)`` and ``U = M V`` (``M = (I + A)^{-1} diag(β)``), ``δ = U − W S_0ᵀ`` — the paper's
Eq. (9) and (11). This module exists to be checked against :mod:`osdn_diag.math.recurrence`: it is
the algebra fla's chunk kernels implement, and the bridge between the two.
"""

from __future__ import annotations

import torch

from ..runtime.checks import check_shape, check_tensor

__all__ = ["chunk_delta_rule"]


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    write_key: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise asymmetric (optionally scalar-gated) delta rule.

    Shapes as :func:`osdn_diag.math.recurrence.delta_rule_recurrence` (``g: [B, T, H]`` log decay
    only; ``T`` need not be a multiple of ``chunk_size``). Returns ``(o [B, T, H, V], S [B, H, V, K])``.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        check_tensor(name, x)
    check_shape("k", k, [None] * 4, "[B, T, H, K]")
    B, T, H, K = k.shape
    check_shape("q", q, [B, T, H, K], "[B, T, H, K]")
    check_shape("v", v, [B, T, H, None], "[B, T, H, V]")
    check_shape("beta", beta, [B, T, H], "[B, T, H]")
    if g is not None:
        check_shape("g", g, [B, T, H], "[B, T, H]")
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"argument 'chunk_size': expected a positive int, got {chunk_size!r}")
    V = v.shape[-1]
    wk = k if write_key is None else write_key
    # [B, H, T, ·] so that a chunk is a contiguous slice of the time axis.
    q, k, wk, v = (x.transpose(1, 2) for x in (q, k, wk, v))
    beta = beta.transpose(1, 2)
    q = q * (K**-0.5 if scale is None else scale)
    logg = None if g is None else g.transpose(1, 2)
    S = q.new_zeros(B, H, V, K) if initial_state is None else initial_state.to(q.dtype).clone()
    o = q.new_empty(B, H, T, V)
    for c0 in range(0, T, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, T))
        qc, kc, wc, vc, bc = q[:, :, sl], k[:, :, sl], wk[:, :, sl], v[:, :, sl], beta[:, :, sl]
        C = kc.shape[2]
        G = q.new_zeros(B, H, C) if logg is None else logg[:, :, sl].cumsum(-1)
        ratio = (G[..., :, None] - G[..., None, :]).exp()  # γ_i / γ_j
        strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
        incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(0)
        A = (bc[..., :, None] * ratio * (kc @ wc.transpose(-1, -2))).masked_fill(~strict, 0)
        rhs = bc[..., None] * (vc - G.exp()[..., None] * (kc @ S.transpose(-1, -2)))
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        delta = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        score = (ratio * (qc @ wc.transpose(-1, -2))).masked_fill(~incl, 0)
        o[:, :, sl] = G.exp()[..., None] * (qc @ S.transpose(-1, -2)) + score @ delta
        tail = (G[..., -1:] - G).exp()  # γ_C / γ_j
        S = G[..., -1].exp()[..., None, None] * S + delta.transpose(-1, -2) @ (tail[..., None] * wc)
    return o.transpose(1, 2), S
