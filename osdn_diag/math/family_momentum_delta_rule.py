"""The momentum delta rule (fla's ``MomentumDeltaNet``), token by token, with per-token losses.

A delta rule whose write goes through a momentum buffer ``M`` (heavy-ball gradient descent on the
token's regression loss). In the package's ``V×K`` convention, per head and token t:

    r_t = S_{t−1} p̃_t − v_t                         residual of the residual key p̃_t
    M_t = μ_t M_{t−1} + r_t k̃_tᵀ                    momentum buffer, μ_t = exp(log_mu_t)
    S_t = α_t S_{t−1} − β_t M_t                      state, α_t = exp(g_t)
    o_t = S_t (scale · q_t)

fla's layer passes ``p = k`` and multiplies it by ``α_t`` in the kernel (``use_p_times_alpha``), so
``r_t = S̄_{t−1} k_t − v_t`` is the gradient of ``f_t`` at the decayed state ``S̄_{t−1} = α_t S_{t−1}``;
the write key is ``k̃_t = η_t k_t`` (``η_t ∈ (0, 2)``). With an empty buffer the step is the gated
delta rule with write gain ``β_t η_t ‖k_t‖²``; a full buffer adds ``−β_t μ_t M_{t−1}``, which is not
along the token's own key and so has no per-token closed form (docs/families.md).

Inputs ``[B, T, H, ·]`` as :mod:`osdn_diag.math.recurrence`; ``initial_state`` and
``initial_momentum`` ``[N, H, V, K]``. The losses are those of the token-local loss
``f_t(S) = ½‖S k_t − v_t‖²`` on the token's own key ``k_t`` (the recorded, normalised key):
``loss_before = f_t(S_{t−1})``, ``loss_before_decayed = f_t(α_t S_{t−1})``, ``loss_after = f_t(S_t)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.checks import check_cu_seqlens, check_finite, check_shape, check_tensor
from .recurrence import RecurrenceResult

__all__ = ["MomentumResult", "momentum_delta_rule_recurrence"]


@dataclass
class MomentumResult(RecurrenceResult):
    """:class:`RecurrenceResult` plus the momentum buffer's final value ``[N, H, V, K]``."""

    final_momentum: torch.Tensor | None = None


def _apply(S: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # A batched matmul per (row, head), so a row's rounding does not depend on the other rows.
    return torch.matmul(S, x[..., None])[..., 0]


def _scan(q, k, v, beta, alpha, mu, wk, rk, S, M):
    """One packed segment: q, k, wk, rk ``[B, L, H, K]``, v ``[B, L, H, V]``, beta/alpha/mu
    ``[B, L, H]``, S and M ``[B, H, V, K]``."""
    B, L, H, _ = k.shape
    o = q.new_empty(B, L, H, v.shape[-1])
    before, before_dec, after = (q.new_empty(B, L, H) for _ in range(3))
    for t in range(L):
        kt, vt = k[:, t], v[:, t]
        a_t = alpha[:, t, :, None, None]
        before[:, t] = 0.5 * (_apply(S, kt) - vt).square().sum(-1)
        before_dec[:, t] = 0.5 * (_apply(a_t * S, kt) - vt).square().sum(-1)
        r = _apply(S, rk[:, t]) - vt
        M = mu[:, t, :, None, None] * M + r[..., :, None] * wk[:, t, :, None, :]
        S = a_t * S - beta[:, t, :, None, None] * M
        after[:, t] = 0.5 * (_apply(S, kt) - vt).square().sum(-1)
        o[:, t] = _apply(S, q[:, t])
    return o, S, M, before, before_dec, after


def momentum_delta_rule_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    log_mu: torch.Tensor,
    *,
    write_key: torch.Tensor,
    residual_key: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    initial_momentum: torch.Tensor | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    dtype: torch.dtype | None = None,
    allow_nonfinite: bool = False,
) -> MomentumResult:
    """The momentum delta rule (module docstring), looped over time, batched over rows and heads.

    Args:
        q, k: ``[B, T, H, K]`` queries and loss keys (used as given, no normalisation).
        v: ``[B, T, H, V]``; beta, g (log α), log_mu: ``[B, T, H]``.
        write_key: ``[B, T, H, K]`` k̃_t, the key the buffer writes along (``η_t k_t`` in fla's layer).
        residual_key: ``[B, T, H, K]`` p̃_t, the key the residual is read with (``α_t k_t``).
        scale: multiplies q in the read-out; ``None`` means ``K ** -0.5``.
        initial_state, initial_momentum: ``[N, H, V, K]``, zeros when ``None``.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (``B == 1``); S and M restart at each.
        dtype: compute dtype; default fp64 if any input is fp64, else fp32.
        allow_nonfinite: let NaN/Inf propagate as a kernel would, instead of refusing them.

    Returns:
        :class:`MomentumResult`: ``o``, ``final_state`` and ``final_momentum`` ``[N, H, V, K]``, the
        three per-token losses, ``write_gain = β_t⟨k̃_t, k_t⟩``.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta), ("g", g), ("log_mu", log_mu),
                    ("write_key", write_key), ("residual_key", residual_key)):
        check_tensor(name, x)
    if k.dim() != 4:
        check_shape("k", k, [None] * 4, "[B, T, H, K]")
    B, T, H, K = k.shape
    V = v.shape[-1]
    for name, x in (("q", q), ("write_key", write_key), ("residual_key", residual_key)):
        check_shape(name, x, [B, T, H, K], "[B, T, H, K]")
    check_shape("v", v, [B, T, H, None], "[B, T, H, V]")
    for name, x in (("beta", beta), ("g", g), ("log_mu", log_mu)):
        check_shape(name, x, [B, T, H], "[B, T, H]")
    offsets = [0, T] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    N = B if cu_seqlens is None else len(offsets) - 1
    for name, x in (("initial_state", initial_state), ("initial_momentum", initial_momentum)):
        if x is not None:
            check_tensor(name, x)
            check_shape(name, x, [N, H, V, K], "[N, H, V, K]")
    if not allow_nonfinite:
        for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta), ("g", g), ("log_mu", log_mu),
                        ("write_key", write_key), ("residual_key", residual_key),
                        ("initial_state", initial_state), ("initial_momentum", initial_momentum)):
            if x is not None:
                check_finite(name, x)
    xs = (q, k, v, beta, g, log_mu, write_key, residual_key, initial_state, initial_momentum)
    cdt = dtype or (torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs)
                    else torch.float32)
    q, k, v, beta, wk, rk = (x.to(cdt) for x in (q, k, v, beta, write_key, residual_key))
    q = q * (K**-0.5 if scale is None else scale)
    alpha, mu = g.to(cdt).exp(), log_mu.to(cdt).exp()
    S0 = q.new_zeros(N, H, V, K) if initial_state is None else initial_state.to(cdt)
    M0 = q.new_zeros(N, H, V, K) if initial_momentum is None else initial_momentum.to(cdt)

    if cu_seqlens is None:
        segments = [(slice(None), S0.clone(), M0.clone())]
    else:
        segments = [(slice(s, e), S0[n : n + 1].clone(), M0[n : n + 1].clone())
                    for n, (s, e) in enumerate(zip(offsets[:-1], offsets[1:]))]
    parts = [_scan(q[:, sl], k[:, sl], v[:, sl], beta[:, sl], alpha[:, sl], mu[:, sl], wk[:, sl], rk[:, sl], S, M)
             for sl, S, M in segments]
    cat = lambda i: torch.cat([p[i] for p in parts], dim=1)  # noqa: E731
    return MomentumResult(
        o=cat(0),
        final_state=torch.cat([p[1] for p in parts], dim=0),
        loss_before=cat(3),
        loss_after=cat(5),
        write_gain=beta * (wk * k).sum(-1),
        loss_before_decayed=cat(4),
        final_momentum=torch.cat([p[2] for p in parts], dim=0),
    )
