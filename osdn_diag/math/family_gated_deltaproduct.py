"""Gated DeltaProduct: ``n_h`` Householder-like delta-rule writes per token, one gate per token.

The reference recurrence of fla's ``GatedDeltaProduct`` layer (kernel ``chunk_gated_delta_product``),
in plain torch, batched over batch and heads, in any precision (fp64 for tests, fp32 for replay).

Conventions (those of :mod:`osdn_diag.math.recurrence`, plus the micro-steps):

* Token inputs ``q: [B, T, H, K]``, ``g: [B, T, H]`` (log decay, ``α_t = exp(g_t)``) or ``None``;
  micro-step inputs ``k: [B, T·n, H, K]``, ``v: [B, T·n, H, V]``, ``beta: [B, T·n, H]``, where
  micro-step ``j`` of token ``t`` is row ``t·n + j`` (fla's interleaving, ``n = num_householder``).
* State ``S ∈ R^{V×K}``, ``[N, H, V, K]``. One token ``t``: decay ``S_{t,−1} = α_t S_{t−1}``; then
  for ``j = 0 … n−1`` the delta-rule write on the micro-step's key and value,
  ``S_{t,j} = S_{t,j−1} + β_{t,j} (v_{t,j} − S_{t,j−1} k_{t,j}) k_{t,j}ᵀ``; ``S_t = S_{t,n−1}``;
  read-out ``o_t = S_t (scale · q_t)``.
* Loss of micro-step ``(t, j)``: ``f_{t,j}(S) = ½‖S k_{t,j} − v_{t,j}‖²``. Per micro-step row
  (layout ``[B, T·n, H]``): ``loss_before = f_{t,j}(S_{t,j−1})`` with ``S_{t,−1}`` read *before* the
  decay for ``j = 0`` (the paper's denominator; ``S_{t−1}``), ``loss_before_decayed = f_{t,0}(α_t
  S_{t−1})`` at ``j = 0`` and ``f_{t,j}(S_{t,j−1})`` at ``j > 0`` (gated only), ``loss_after =
  f_{t,j}(S_{t,j})``.
* The token's loss: ``L_t(S) = Σ_j f_{t,j}(S)``, the sum of its ``n`` micro-step pairs' losses, read
  at three states — ``token_loss_before = L_t(S_{t−1})`` (before the token's decay, the paper's
  denominator), ``token_loss_before_decayed = L_t(α_t S_{t−1})`` (gated only) and ``token_loss_after
  = L_t(S_t)`` (after its last micro-step). Per token, on each of its micro-step rows (``columns``):
  ``token_ratio = L_t(S_t) / L_t(S_{t−1})`` and ``token_ratio_post = L_t(S_t) / L_t(α_t S_{t−1})``
  (gated only), both 1 where the loss before is 0 (the paper's convention): ratios of *one* loss, so
  with ``n = 1`` they are the delta rule's ``residual_ratio`` and ``residual_ratio_post``.
  ``micro_step_ratio_product = Π_j q_{t,j}`` with ``q_{t,j} = loss_after / loss_before`` (1 where
  ``loss_before = 0``) and ``micro_step_ratio_product_post`` the same with the post-decay ratio at
  ``j = 0`` (gated only): products of ratios of *different* losses (each micro-step's own pair), kept
  beside the token's ratio; and ``step = j``.
* ``cu_seqlens`` counts *tokens* (``[N + 1]``, ``B = 1``); the state restarts at every boundary.
"""

from __future__ import annotations

import torch

from .recurrence import RecurrenceResult

__all__ = ["gated_deltaproduct_recurrence", "token_columns"]


def _ratio(after: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    # The paper's convention: a write against a loss already zero has ratio 1.
    return torch.where(before > 0, after / torch.where(before > 0, before, 1.0), torch.ones_like(after))


def _token_loss(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``L_t(S) = Σ_j ½‖S k_{t,j} − v_{t,j}‖²`` for states ``[b, H, V, K]`` and a token's pairs
    ``k: [b, n, H, K]``, ``v: [b, n, H, V]``: ``[b, H]``."""
    return 0.5 * (torch.einsum("bhvk,bjhk->bjhv", S, k) - v).square().sum((1, 3))


def token_columns(
    loss_before: torch.Tensor,
    loss_after: torch.Tensor,
    loss_before_decayed: torch.Tensor | None,
    num_householder: int,
    token_losses: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The per-token columns, each ``[B, T·n, H]`` (a token's value repeated on its n rows): ``step``,
    ``token_ratio``, ``micro_step_ratio_product``, ``token_loss_before``, ``token_loss_after`` and,
    gated, ``token_ratio_post``, ``micro_step_ratio_product_post``, ``token_loss_before_decayed``.

    ``loss_*`` are the micro-step losses ``[B, T·n, H]``; ``token_losses`` the token's loss ``L_t``
    (module docstring) at its three states, ``[B, T, H]`` each, keyed ``"before"``, ``"after"`` and,
    gated, ``"before_decayed"``. Micro-step ``j`` of token ``t`` is row ``t·n + j`` in every
    sequence; packed sequences start at multiples of ``n`` (fla multiplies ``cu_seqlens`` by ``n``),
    so the grouping is global."""
    B, Tn, H = loss_before.shape
    n = int(num_householder)
    if Tn % n:
        raise ValueError(f"{Tn} micro-steps are not a whole number of tokens of {n} micro-steps")
    T = Tn // n

    def repeat(x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T·n, H]
        return x[:, :, None].expand(B, T, n, H).reshape(B, Tn, H)

    def product(x: torch.Tensor) -> torch.Tensor:  # [B, T·n, H] -> its tokens' products, [B, T·n, H]
        return repeat(x.reshape(B, T, n, H).prod(2))

    before, after = token_losses["before"], token_losses["after"]
    step = torch.arange(n, device=loss_before.device, dtype=loss_before.dtype).repeat(T)[None, :, None]
    out = {
        "step": step.expand(B, Tn, H).contiguous(),
        "token_ratio": repeat(_ratio(after, before)),
        "micro_step_ratio_product": product(_ratio(loss_after, loss_before)),
        "token_loss_before": repeat(before),
        "token_loss_after": repeat(after),
    }
    if loss_before_decayed is not None:
        decayed = token_losses["before_decayed"]
        out["token_ratio_post"] = repeat(_ratio(after, decayed))
        # Only micro-step 0 carries the decay; at j > 0 the post-decay ratio is the ratio itself.
        out["micro_step_ratio_product_post"] = product(_ratio(loss_after, loss_before_decayed))
        out["token_loss_before_decayed"] = repeat(decayed)
    return out


def gated_deltaproduct_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    num_householder: int,
    *,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
) -> RecurrenceResult:
    """Run the recurrence of the module docstring. Returns a
    :class:`~osdn_diag.math.recurrence.RecurrenceResult` with ``o: [B, T, H, V]`` (token layout),
    ``final_state: [N, H, V, K]`` and the per-row values in the micro-step layout ``[B, T·n, H]``;
    ``write_gain = β_{t,j}‖k_{t,j}‖²``; ``columns`` as :func:`token_columns`, the token's loss read
    at ``S_{t−1}``, ``α_t S_{t−1}`` and ``S_t`` directly, with all its pairs' keys."""
    n = int(num_householder)
    if n < 1:
        raise ValueError(f"argument 'num_householder': expected at least 1, got {n}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != (B, T * n, H, K) or v.shape[:3] != (B, T * n, H) or beta.shape != (B, T * n, H):
        raise ValueError(
            f"micro-step inputs must be [B, T·n, H, ·] = [{B}, {T * n}, {H}, ·] for q {tuple(q.shape)}, "
            f"n = {n}; got k {tuple(k.shape)}, v {tuple(v.shape)}, beta {tuple(beta.shape)}"
        )
    if g is not None and g.shape != (B, T, H):
        raise ValueError(f"argument 'g': expected [B, T, H] = [{B}, {T}, {H}], got {tuple(g.shape)}")
    scale = K**-0.5 if scale is None else float(scale)
    dev = q.device
    qd, kd, vd, bd = (x.to(dtype) for x in (q, k, v, beta))
    gd = None if g is None else g.to(dtype)
    if cu_seqlens is None:
        segments = [(slice(None), 0, T, None)]
        N = B
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens needs batch size 1, got {B}")
        offs = [int(x) for x in cu_seqlens.tolist()]
        segments = [(slice(0, 1), s, e, i) for i, (s, e) in enumerate(zip(offs[:-1], offs[1:]))]
        N = len(segments)
    o = torch.zeros(B, T, H, V, dtype=dtype, device=dev)
    before = torch.zeros(B, T * n, H, dtype=dtype, device=dev)
    after = torch.zeros_like(before)
    decayed = None if g is None else torch.zeros_like(before)
    tok = {name: torch.zeros(B, T, H, dtype=dtype, device=dev) for name in ("before", "after")}
    if g is not None:
        tok["before_decayed"] = torch.zeros(B, T, H, dtype=dtype, device=dev)
    final = torch.zeros(N, H, V, K, dtype=dtype, device=dev)
    for rows, start, end, i in segments:
        b = B if i is None else 1
        if initial_state is None:
            S = torch.zeros(b, H, V, K, dtype=dtype, device=dev)
        else:
            S = (initial_state if i is None else initial_state[i : i + 1]).to(dtype).clone()
        for t in range(start, end):
            rs = slice(t * n, t * n + n)
            kt, vt = kd[rows, rs], vd[rows, rs]  # the token's n pairs, [b, n, H, K], [b, n, H, V]
            tok["before"][rows, t] = _token_loss(S, kt, vt)
            if gd is not None:
                tok["before_decayed"][rows, t] = _token_loss(S * gd[rows, t].exp()[..., None, None], kt, vt)
            for j in range(n):
                r = t * n + j
                kj, vj, bj = kd[rows, r], vd[rows, r], bd[rows, r]  # [b, H, K], [b, H, V], [b, H]
                before[rows, r] = 0.5 * (torch.einsum("bhvk,bhk->bhv", S, kj) - vj).square().sum(-1)
                if j == 0 and gd is not None:
                    S = S * gd[rows, t].exp()[..., None, None]
                u = vj - torch.einsum("bhvk,bhk->bhv", S, kj)
                if decayed is not None:
                    decayed[rows, r] = 0.5 * u.square().sum(-1)
                S = S + bj[..., None, None] * u[..., :, None] * kj[..., None, :]
                after[rows, r] = 0.5 * (torch.einsum("bhvk,bhk->bhv", S, kj) - vj).square().sum(-1)
            tok["after"][rows, t] = _token_loss(S, kt, vt)
            o[rows, t] = torch.einsum("bhvk,bhk->bhv", S, scale * qd[rows, t])
        if i is None:
            final = S
        else:
            final[i] = S[0]
    gain = bd * kd.square().sum(-1)
    return RecurrenceResult(
        o=o, final_state=final, loss_before=before, loss_after=after, write_gain=gain,
        loss_before_decayed=decayed, columns=token_columns(before, after, decayed, n, tok),
    )
