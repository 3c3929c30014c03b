"""OSDN phase 1: the online diagonal preconditioner sweep (Algorithm 1, Eq. 4/7/12), in plain torch.

For every (sequence, head) the sweep keeps one vector ``d ∈ R^K`` and, token by token,

1. emits the write key ``k̃_t = d_t ⊙ k_t`` — *before* touching ``d`` (Algorithm 1, line 5; the
   paper's Fig. 1 draws ``d_{t+1}`` here, the algorithm and its listings do not);
2. takes one projected hypergradient step on ``h_t``::

       s_t = k_t ⊙ k_t,   n_t = max(‖k_t‖², ε),   β'_t = β_t (beta-aware) or 1
       d_{t+1} = Π_[d_min, d_max]( r_t ⊙ d_t + η β'_t (1 − β'_t ⟨d_t, s_t⟩) / n_t · s_t )

   with retention ``r_t ≡ 1`` (plain OSDN), a head-token scalar (APF) or a per-channel vector.

The step is exactly ``d − η ∇h_t(d)`` of :func:`osdn_diag.math.closed_forms.surrogate_grad` (with
``β'`` for β and the same ε floor); the tests hold the two to each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runtime.checks import check_box, check_cu_seqlens, check_finite, check_shape, check_tensor

__all__ = ["Phase1Result", "osdn_phase1"]


@dataclass
class Phase1Result:
    """Output of the phase-1 sweep for ``N`` sequences of total length ``T``.

    Attributes:
        write_key: ``[B, T, H, K]`` — ``k̃_t = d_t ⊙ k_t``, what phase 2 writes with.
        d: ``[B, T, H, K]`` — ``d_t``, the preconditioner *used at* token ``t``.
        d_final: ``[N, H, K]`` — ``d_{T+1}``, the state after the last token of each sequence.
    """

    write_key: torch.Tensor
    d: torch.Tensor
    d_final: torch.Tensor


def _validate(k, beta, retention, d0, eta, d_min, d_max, eps, cu_seqlens, device=None, allow_nonfinite=False):
    """Check phase 1's arguments; return ``(offsets, N)``. ``device``: where ``cu_seqlens`` must be
    (the kernels' callers pass the keys' device; the reference reads the offsets wherever they are)."""
    check_tensor("k", k)
    if k.dim() != 4:
        check_shape("k", k, [None] * 4, "[B, T, H, K]")
    B, T, H, K = k.shape
    check_tensor("beta", beta)
    check_shape("beta", beta, [B, T, H], "[B, T, H]")
    if not allow_nonfinite:
        check_finite("k", k)
        check_finite("beta", beta)
    check_box(d_min, d_max)
    if not (isinstance(eta, (int, float)) and math.isfinite(eta) and eta >= 0):
        raise ValueError(f"argument 'eta': expected a finite number >= 0, got {eta!r}")
    if not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"argument 'eps': expected a number > 0, got {eps!r}")
    offsets = [0, T] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T, device)
    N = B if cu_seqlens is None else len(offsets) - 1
    if retention is not None:
        check_tensor("retention", retention)
        if retention.dim() == 3:
            check_shape("retention", retention, [B, T, H], "[B, T, H]")
        else:
            check_shape("retention", retention, [B, T, H, K], "[B, T, H] or [B, T, H, K]")
        check_finite("retention", retention)
        if bool((retention < 0).any() | (retention > 1).any()):
            raise ValueError("argument 'retention': expected values in [0, 1]")
    if d0 is not None:
        check_tensor("d0", d0)
        if d0.dim() == 2:
            check_shape("d0", d0, [H, K], "[H, K]")
        else:
            check_shape("d0", d0, [N, H, K], "[H, K] or [N, H, K]")
        check_finite("d0", d0)
        if d_min is not None and bool(((d0 < d_min) | (d0 > d_max)).any()):
            raise ValueError(
                f"argument 'd0': expected every entry inside the box [{d_min}, {d_max}], got range "
                f"[{float(d0.min()):.6g}, {float(d0.max()):.6g}]"
            )
        if d_min is None and bool((d0 <= 0).any()):
            raise ValueError("argument 'd0': expected positive entries")
    elif d_min is not None and not d_min <= 1.0 <= d_max:
        raise ValueError(
            f"argument 'd0': the default d0 = 1 lies outside the box [{d_min}, {d_max}]; "
            "pass a d0 inside it"
        )
    return offsets, N


def osdn_phase1(
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
    dtype: torch.dtype | None = None,
    allow_nonfinite: bool = False,
) -> Phase1Result:
    """Run the phase-1 preconditioner sweep; see the module docstring for the recurrence.

    Args:
        k: ``[B, T, H, K]`` keys, as the state kernel reads them (after any normalisation).
        beta: ``[B, T, H]`` write strengths.
        retention: ``None`` (r ≡ 1), ``[B, T, H]`` (APF: one scalar per head and token) or
            ``[B, T, H, K]`` (per channel); values in [0, 1].
        d0: initial ``d``, ``[H, K]`` (shared by every sequence) or ``[N, H, K]``; ones when ``None``
            (then 1 must lie inside the box).
        eta: online step size η ≥ 0 (0 freezes ``d`` at ``d0``).
        d_min, d_max: the box ``[d_min, d_max]^K`` (``0 < d_min ≤ d_max``); both ``None`` disables the
            projection.
        beta_aware: use ``β'_t = β_t`` (Eq. 12); ``False`` is the paper's 1.3B form ``β'_t = 1``.
        eps: floor on ``‖k_t‖²``.
        cu_seqlens: ``[N + 1]`` packed-sequence offsets (``B == 1``); ``d`` restarts from ``d0`` at
            every boundary.
        dtype: compute dtype; default fp64 for fp64 keys, else fp32 (also for bf16 keys).
        allow_nonfinite: accept NaN/Inf keys and β and let them propagate as the kernel would (``d``
            of that sequence and head is NaN from the token on); by default they are an error.
    """
    offsets, N = _validate(k, beta, retention, d0, eta, d_min, d_max, eps, cu_seqlens,
                           allow_nonfinite=allow_nonfinite)
    B, T, H, K = k.shape
    cdt = dtype or (torch.float64 if k.dtype == torch.float64 else torch.float32)
    k, beta = k.to(cdt), beta.to(cdt)
    r = None
    if retention is not None:
        r = retention.to(cdt)
        r = r[..., None] if r.dim() == 3 else r
    if d0 is None:
        init = k.new_ones(N, H, K)
    else:
        init = d0.to(cdt).expand(N, H, K) if d0.dim() == 2 else d0.to(cdt)

    s = k * k
    inv_n = 1.0 / s.sum(-1).clamp_min(eps)
    bp = beta if beta_aware else torch.ones_like(beta)
    d_traj = torch.empty_like(k)
    finals = []
    # An unpacked batch runs all B rows together; a packed one runs one segment at a time.
    if cu_seqlens is None:
        segments = [(slice(None), 0, T, init)]
    else:
        bounds = zip(offsets[:-1], offsets[1:])
        segments = [(slice(0, 1), bos, eos, init[i : i + 1]) for i, (bos, eos) in enumerate(bounds)]
    for rows, bos, eos, d in segments:
        d = d.clone()
        for t in range(bos, eos):
            d_traj[rows, t] = d
            st = s[rows, t]
            step = eta * bp[rows, t] * (1.0 - bp[rows, t] * (d * st).sum(-1)) * inv_n[rows, t]
            d = (d if r is None else r[rows, t] * d) + step[..., None] * st
            if d_min is not None:
                d = d.clamp(d_min, d_max)
        finals.append(d)
    return Phase1Result(write_key=d_traj * k, d=d_traj, d_final=torch.cat(finals, dim=0))
