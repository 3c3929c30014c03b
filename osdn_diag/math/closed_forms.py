"""Closed forms of the OSDN theory (Lemma 4.1, Lemma D.6, Theorem D.7), vectorised over leading axes.

Notation: ``s = k ⊙ k`` and ``n = ‖k‖²`` (floored at ``eps`` where stated). The write gain is
``a = β⟨d, s⟩``. For any ``k ≠ 0`` and any residual ``u ≠ 0`` one write gives

    f_t(S_t) / f_t(S_{t−1}) = (1 − a_t)²                          (Lemma 4.1's computation)
    h_t(d) = ((1 − β⟨d, s⟩)² − 1) / (2n)                          (Eq. 3 / Eq. 18)

so ``q_t = 1 + 2 n_t h_t(d_t)``, and ``q_t = 1 + 2 h_t(d_t)`` only for unit keys.

Stream functions (:func:`comparator_gap`, :func:`regret`) take the time axis second to last:
``k: [..., T, K]``, ``beta: [..., T]``, comparator ``d: [..., K]``, trajectory ``d_traj: [..., T, K]``.
"""

from __future__ import annotations

import torch

__all__ = [
    "comparator_gap",
    "log_bound",
    "regret",
    "residual_ratio",
    "surrogate",
    "surrogate_grad",
    "surrogate_hessian",
    "write_gain",
]


def write_gain(k: torch.Tensor, beta: torch.Tensor, d: torch.Tensor | None = None) -> torch.Tensor:
    """``a = β⟨d, k⊙k⟩`` (``d ≡ 1`` when ``None``). ``k, d: [..., K]``, ``beta: [...]`` → ``[...]``."""
    s = k * k
    return beta * (s.sum(-1) if d is None else (d * s).sum(-1))


def _norm(k: torch.Tensor, eps: float) -> torch.Tensor:
    n = (k * k).sum(-1)
    return n.clamp_min(eps) if eps > 0 else n


def surrogate(d: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, *, eps: float = 0.0) -> torch.Tensor:
    """Token-local hypergradient surrogate ``h(d) = ((1 − β⟨d,s⟩)² − 1) / (2 max(n, eps))`` → ``[...]``.

    With ``eps = 0`` this is the exact Eq. (18) (undefined at ``k = 0``); phase 1 uses the floored
    form, of which it is exact online gradient descent.
    """
    return ((1.0 - write_gain(k, beta, d)) ** 2 - 1.0) / (2.0 * _norm(k, eps))


def surrogate_grad(d: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, *, eps: float = 0.0) -> torch.Tensor:
    """``∇h(d) = −β (1 − β⟨d,s⟩) / n · s`` → ``[..., K]``."""
    s = k * k
    coef = -beta * (1.0 - write_gain(k, beta, d)) / _norm(k, eps)
    return coef[..., None] * s


def surrogate_hessian(k: torch.Tensor, beta: torch.Tensor, *, eps: float = 0.0) -> torch.Tensor:
    """``∇²h = β²/n · s sᵀ`` (constant in d, rank one, PSD) → ``[..., K, K]``."""
    s = k * k
    return (beta**2 / _norm(k, eps))[..., None, None] * s[..., :, None] * s[..., None, :]


def residual_ratio(loss_after: torch.Tensor, loss_before: torch.Tensor) -> torch.Tensor:
    """``q = f_t(S_t) / f_t(S_{t−1})`` with the paper's convention ``q = 1`` where the denominator is 0."""
    zero = loss_before == 0
    return torch.where(zero, torch.ones_like(loss_after), loss_after / torch.where(zero, 1.0, loss_before))


def comparator_gap(d: torch.Tensor, k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``ε_T(d) = 1/(2T) Σ_t (1 − β_t⟨d, s_t⟩)²`` for a fixed comparator ``d: [..., K]`` → ``[...]``."""
    a = write_gain(k, beta, d[..., None, :])
    return 0.5 * ((1.0 - a) ** 2).mean(-1)


def regret(
    d_traj: torch.Tensor, d: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, *, eps: float = 0.0
) -> torch.Tensor:
    """Realised regret ``R_T(d) = Σ_t h_t(d_t) − h_t(d)`` of a trajectory ``d_traj: [..., T, K]`` against a
    fixed comparator ``d: [..., K]`` → ``[...]``."""
    h_alg = surrogate(d_traj, k, beta, eps=eps)
    h_cmp = surrogate(d[..., None, :].expand_as(d_traj), k, beta, eps=eps)
    return (h_alg - h_cmp).sum(-1)


def log_bound(eps_T: torch.Tensor, regret_T: torch.Tensor, T: int) -> torch.Tensor:
    """Theorem D.7's right-hand side in log space: ``T · log(2 ε_T(d) + 2 R_T(d) / T)``.

    ``-inf`` where the base is 0; NaN where it is negative (the theorem's hypotheses fail). The base is a
    difference of O(1) terms (each ``h_t`` carries a ``−1/(2n_t)``), so a true 0 can round to a tiny
    negative number: values within a few ulps of ``1 + 2ε_T + 2|R_T|/T`` below 0 count as 0, not as a
    failed hypothesis.
    """
    base = 2.0 * eps_T + 2.0 * regret_T / T
    tol = 16 * torch.finfo(base.dtype).eps * (1.0 + 2.0 * eps_T.abs() + 2.0 * regret_T.abs() / T)
    base = torch.where((base < 0) & (base >= -tol), torch.zeros_like(base), base)
    return T * torch.log(base)
