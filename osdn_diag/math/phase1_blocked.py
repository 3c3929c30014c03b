"""OSDN phase 1 in blocks of tokens, without a sequential chain through K: the specification of a
parallel phase-1 kernel. Exact: it agrees with the sequential sweep to rounding, clamp included.

:func:`osdn_diag.math.phase1.osdn_phase1` walks the tokens one at a time because every step reads
``⟨d_t, s_t⟩``, a reduction over K on the critical path. Two observations remove it:

1. **Given the step sizes, the coordinates are independent.** With ``c_t = α_t − γ_t ⟨d_t, s_t⟩``
   (``α_t = η p_t / n_t``, ``γ_t = α_t p_t``; see :mod:`osdn_diag.ops.phase1`) each coordinate follows
   ``d_{t+1,i} = f_{t,i}(d_{t,i})`` with ``f_{t,i}(x) = clamp(r_t x + c_t s_{t,i}, d_min, d_max)``.
   Maps ``x ↦ min(max(a x + b, lo), hi)`` with ``a ≥ 0`` are closed under composition::

       (a₂, b₂, lo₂, hi₂) ∘ (a₁, b₁, lo₁, hi₁) = (a₂a₁, a₂b₁ + b₂, clamp(a₂lo₁ + b₂, lo₂, hi₂), clamp(a₂hi₁ + b₂, lo₂, hi₂))

   so a whole block's clamped trajectory is one associative scan over tokens — log depth, K-parallel,
   no reduction (:func:`clamped_affine_scan`).
2. **The step sizes are the fixed point of a causal map.** ``c = α − γ ⊙ ⟨D(c), s⟩``, where token t's
   entry depends only on ``c_0 … c_{t−1}``: Picard iteration from any start is exact for one more
   token per round at worst, and converges much faster when the coupling ``γ_t ⟨·, s_t⟩`` is weak
   (it is ``O(η β² / K)``). Each round is one scan and one batch of reductions, all in parallel.

Per block of ``block`` tokens: start from ``c`` computed with ``d`` frozen at the block's start, iterate
``c ← α − γ ⊙ ⟨D(c), s⟩`` until it stops changing (at most ``block + 1`` rounds), emit ``D``. Measured
(1,024 tokens, unit keys, β uniform; rounds per block, most of any block): at the paper's setting
(K = 128, η = 0.003) one round in fp32 for blocks of 16–64 tokens — d moves so little inside a block
that the first guess is already the fixed point — and 2–4 in fp64; at η = 0.5, K = 64 (the built-in
models), 4–5 in fp32 and 8–10 in fp64, with or without an APF-like retention that keeps the clamp
busy. fp32 results are within 2e-7 of the fp64 sequential sweep. This
module is the plain-torch statement (the scan by doubling, as a kernel would do it); the tests hold it
to the sequential sweep in fp64 and count the rounds.
"""

from __future__ import annotations

import torch

from .phase1 import Phase1Result, _validate

__all__ = ["BlockedStats", "clamped_affine_scan", "osdn_phase1_blocked"]


class BlockedStats:
    """What a blocked sweep did: ``blocks`` and ``rounds`` (Picard rounds, summed over blocks), and the
    largest number of rounds one block needed (``max_rounds``)."""

    def __init__(self) -> None:
        self.blocks = 0
        self.rounds = 0
        self.max_rounds = 0

    def __repr__(self) -> str:
        return f"BlockedStats(blocks={self.blocks}, rounds={self.rounds}, max_rounds={self.max_rounds})"


def _times(a, bound):
    """``a · bound`` for bounds that may be ±inf (no box): a map with ``a = 0`` forgets its input,
    bound included, where plain multiplication would give 0 · inf = nan."""
    return a * torch.where(a == 0, torch.zeros_like(bound), bound)


def clamped_affine_scan(a, b, lo, hi, x0):
    """Inclusive prefix composition of ``f_t(x) = min(max(a_t x + b_t, lo_t), hi_t)`` applied to ``x0``.

    Args: ``a, b, lo, hi: [n, K]`` with ``a ≥ 0`` and ``lo ≤ hi``; ``x0: [K]``.
    Returns ``[n + 1, K]``: ``x0, f_0(x0), f_1(f_0(x0)), …``. Computed by doubling (Hillis–Steele),
    ``ceil(log2 n)`` rounds of the composition rule in the module docstring.
    """
    a, b, lo, hi = a.clone(), b.clone(), lo.clone(), hi.clone()
    n = a.shape[0]
    step = 1
    while step < n:
        # Element t becomes (element t) ∘ (element t − step): later maps are applied last.
        a1, b1, lo1, hi1 = a[:-step], b[:-step], lo[:-step], hi[:-step]
        a2, b2, lo2, hi2 = a[step:], b[step:], lo[step:], hi[step:]
        new = (a2 * a1, a2 * b1 + b2,
               torch.minimum(torch.maximum(_times(a2, lo1) + b2, lo2), hi2),
               torch.minimum(torch.maximum(_times(a2, hi1) + b2, lo2), hi2))
        a, b, lo, hi = (torch.cat([x[:step], y]) for x, y in zip((a, b, lo, hi), new))
        step *= 2
    out = torch.minimum(torch.maximum(a * x0 + b, lo), hi)
    return torch.cat([x0[None], out])


def _stream(s, alpha, gam, r, d, d_min, d_max, block, stats):
    """One (sequence, head): ``s, r: [L, K]``, ``alpha, gam: [L]``, ``d: [K]``. Returns the trajectory
    ``[L, K]`` (the d used at each token) and the final d."""
    L, K = s.shape
    traj = torch.empty_like(s)
    lo_v = -torch.inf if d_min is None else d_min
    hi_v = torch.inf if d_max is None else d_max
    tol = 8 * torch.finfo(s.dtype).eps
    for pos in range(0, L, block):
        n = min(block, L - pos)
        S, A, G, R = s[pos : pos + n], alpha[pos : pos + n], gam[pos : pos + n], r[pos : pos + n]
        lo, hi = torch.full_like(S, lo_v), torch.full_like(S, hi_v)
        c = A - G * (S * d).sum(-1)  # the first guess: d frozen at the block's start
        for rounds in range(1, n + 2):
            D = clamped_affine_scan(R, c[:, None] * S, lo, hi, d)
            c_new = A - G * (D[:n] * S).sum(-1)
            if bool(((c_new - c).abs() <= tol * (1 + c.abs())).all()):
                break  # D is the trajectory of (to rounding) the fixed point
            c = c_new
        stats.blocks += 1
        stats.rounds += rounds
        stats.max_rounds = max(stats.max_rounds, rounds)
        traj[pos : pos + n] = D[:n]
        d = D[n]
    return traj, d


def osdn_phase1_blocked(
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
    block: int = 32,
    dtype: torch.dtype | None = None,
    stats: BlockedStats | None = None,
) -> Phase1Result:
    """The phase-1 sweep of :func:`~osdn_diag.math.phase1.osdn_phase1` (same arguments, same result up
    to rounding), computed in blocks of ``block`` tokens; ``stats`` (a :class:`BlockedStats`) counts
    the blocks and Picard rounds."""
    offsets, N = _validate(k, beta, retention, d0, eta, d_min, d_max, eps, cu_seqlens)
    if not (isinstance(block, int) and block >= 1):
        raise ValueError(f"argument 'block': expected an integer >= 1, got {block!r}")
    stats = stats if stats is not None else BlockedStats()
    B, T, H, K = k.shape
    cdt = dtype or (torch.float64 if k.dtype == torch.float64 else torch.float32)
    k, beta = k.to(cdt), beta.to(cdt)
    s = k * k
    p = beta if beta_aware else torch.ones_like(beta)
    alpha = eta * p / s.sum(-1).clamp_min(eps)
    gam = alpha * p
    if retention is None:
        r = torch.ones_like(k)
    else:
        r = retention.to(cdt)
        r = (r[..., None] if r.dim() == 3 else r).expand(B, T, H, K)
    if d0 is None:
        init = k.new_ones(N, H, K)
    else:
        init = d0.to(cdt).expand(N, H, K) if d0.dim() == 2 else d0.to(cdt)
    if cu_seqlens is None:
        segments = [(b, 0, T, b) for b in range(B)]
    else:
        segments = [(0, bos, eos, i) for i, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:]))]
    d_traj = torch.empty_like(k)
    d_final = init.clone()
    for row, bos, eos, seq in segments:
        for h in range(H):
            sl = slice(bos, eos)
            traj, fin = _stream(s[row, sl, h], alpha[row, sl, h], gam[row, sl, h], r[row, sl, h],
                                init[seq, h].clone(), d_min, d_max, block, stats)
            d_traj[row, sl, h] = traj
            d_final[seq, h] = fin
    return Phase1Result(write_key=d_traj * k, d=d_traj, d_final=d_final)
