"""The diagonal comparator gap ``ε_T^diag`` of Theorem D.7: a batched box-constrained least-squares solver.

For one stream (a (prompt, layer, head)) with keys ``k_t``, gates ``β_t`` and the set ``V`` of valid
tokens (``u_t ≠ 0``; ``T_eff = |V|``)::

    ε_T(d) = 1/(2 T_eff) Σ_{t∈V} (1 − β_t⟨d, s_t⟩)²,   s_t = k_t ⊙ k_t,
    ε_T^diag = min_{d ∈ [d_min, d_max]^K} ε_T(d).

With ``A = diag(β) S`` (rows ``β_t s_tᵀ``, valid tokens only) this is ``½ dᵀGd − cᵀd + c0`` with
``G = AᵀA / T_eff`` (PSD, often singular: ``s_t ≥ 0``, dead channels, ``T_eff < K``), ``c = Aᵀ1 / T_eff``
and ``c0 = ½``. A problem with no valid token has ``G = 0, c = 0, c0 = 0``: its value is 0 (an empty
mean is taken as 0), every ``d`` in the box is a minimiser (we return ``Π_box(1)`` or ``d_init``) and
its gap is 0.

Algorithm (:func:`solve_box_lsq`): gradient projection with Newton subspace steps — the scheme of
L-BFGS-B and of Moré & Toraldo's GPCG, with the exact Hessian ``G`` — on the K×K normal equations, all
problems in lock-step, each leaving the batch once it is certified. One iteration, from a feasible ``d``
with gradient ``g = Gd − c``:

1. *Cauchy point* ``d_C``: the best point of the projected-gradient path ``Π(d − t g)`` over
   ``t ∈ {2^j / L : j = 0..15}`` (``L`` ≥ λ_max(G), Gershgorin) and the exact line minimiser
   ``gᵀg / gᵀGg``. The step ``1/L`` alone gives the usual sufficient decrease, so the method converges
   like projected gradient in the worst case; the long steps put many coordinates on their bounds at
   once.
2. *Newton on the face of d_C*: with the free coordinates ``F`` solve ``G_FF p = −g_F`` by Cholesky of
   ``G_FF + μI`` (``μ = 1e-12 · max diag G``) plus two steps of iterative refinement. The system is
   always consistent (``g_F ∈ range(A_Fᵀ) = range(G_FF)``), so this reaches a minimiser of the face even
   when ``G_FF`` is singular; a Cholesky failure (rounding) retries with a larger ``μ``. Two candidate
   families use it: up to four steps of the primal active-set method of Lawson–Hanson/BVLS (fix the
   coordinates on a bound whose gradient — or Newton step — points outward, move along ``p`` until the
   first free coordinate meets its bound, fix it and solve again, or stop at ``τ = 1``), which stays in
   the box when the face's minimisers form a flat (rank-deficient or nearly so ``G_FF``: the
   minimum-norm Newton step may then leave the box although minimisers inside it exist), and Bertsekas'
   projected Newton path ``Π(d_C + αp)``, ``α = 1, ½, …, 2^-11``, with the ε-active set on its bounds,
   which moves many coordinates to their bounds at once.
3. *Selection*: the candidate of least value wins; among candidates whose values differ by less than
   the rounding floor (32 ulp of ``|½dᵀGd| + |cᵀd| + |c0|``) the one of least gap wins. The second rule
   matters: near the solution the last Newton step lowers the value by less than an ulp but the gap
   by orders of magnitude.

A problem stops when its Frank–Wolfe gap ``max_{y∈box} ∇ε(d)ᵀ(d − y)`` — a certified upper bound on
``ε(d) − min ε`` by convexity — is ``≤ tol · (1 + ε(d))``, or when an iteration moves neither the value
(beyond the floor) nor the gap (the rounding floor; ``converged`` then says whether the gap made it).
Once the active set is identified the Newton step is exact, so the count is small: 6–9 iterations on
synthetic unit-key streams at T = 2,048, K = 128 (``benchmarks/bench_comparator.py``: the paper shape,
P = 9,216, takes 0.62 s on one H200, 0.46 s of it in the solver), up to ~40 on ill-conditioned or
rank-deficient ones (T ≤ K); the count is returned. Why not FISTA: on a singular ``G`` only its
worst-case bound ``2L‖d₁ − d*‖²/k²`` applies, which asks for k ≈ 2·10⁶ iterations for a 1e-10 gap at
K = 128 (L ≈ 1, ‖d₁ − d*‖² ≤ 288); a Newton step costs one batched K×K Cholesky (P · K³/3 flops).

Everything is deterministic (fixed chunking, no atomics, ties broken by order). :func:`normal_equations`
accumulates ``G`` in fp64 by default, in blocks of at most ``block_elems`` elements along P and T, so
the paper shape (P = 9,216, T = 2,048, K = 128; 9.7 GB of fp32 keys) needs about 6·P·K² fp64 numbers
of working memory beyond the inputs (measured peak on the GPU: 17.5 GiB, of which 9.1 GiB inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runtime.checks import check_box, check_shape, check_tensor

__all__ = [
    "BoxLSQResult",
    "comparator_gap_diag",
    "comparator_gap_masked",
    "normal_equations",
    "solve_box_lsq",
]

#: default number of fp64 elements in one working block (256 MiB)
BLOCK_ELEMS = 1 << 25
_N_LINE_SEARCH = 12
_N_CAUCHY = 16


@dataclass
class BoxLSQResult:
    """Solution of ``P`` box-constrained least-squares problems in ``K`` unknowns.

    Attributes:
        d: ``[P, K]`` a minimiser (one of them when it is not unique).
        value: ``[P]`` ``ε_T(d)``.
        kkt_residual: ``[P]`` ``‖d − Π_box(d − ∇ε_T(d))‖∞`` (projected-gradient stationarity);
            ``kkt_residual² ≤ gap`` always (per coordinate ``min(|g_i|, r_i)² ≤ |g_i| r_i``, ``r_i`` the
            distance to the bound ``g_i`` points to), and nothing tighter is promised: along a nearly
            flat direction a certified value sits beside a gradient of ~√gap.
        gap: ``[P]`` ``max_{y∈box} ∇ε_T(d)ᵀ(d − y) ≥ 0``, a certified upper bound on ``value − min``.
        iterations: Newton iterations of the slowest problem.
        converged: ``[P]`` bool, ``gap ≤ tol · (1 + value)``.
    """

    d: torch.Tensor
    value: torch.Tensor
    kkt_residual: torch.Tensor
    gap: torch.Tensor
    iterations: int
    converged: torch.Tensor


# ------------------------------------------------------------------------------------------ validation


def _check_box_finite(d_min, d_max) -> tuple[float, float]:
    for name, x in (("d_min", d_min), ("d_max", d_max)):
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"argument {name!r}: expected a finite number, got {x!r}")
    check_box(d_min, d_max)
    return float(d_min), float(d_max)


def _check_mask(mask, P: int, T: int, name: str = "mask") -> None:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"argument {name!r}: expected a bool tensor [P, T], got {got}")
    check_shape(name, mask, [P, T], "[P, T]")


def _check_stream(k, beta, mask) -> tuple[int, int, int]:
    check_tensor("k", k)
    if k.dim() != 3:
        check_shape("k", k, [None] * 3, "[P, T, K]")
    P, T, K = k.shape
    check_tensor("beta", beta)
    check_shape("beta", beta, [P, T], "[P, T]")
    if mask is not None:
        _check_mask(mask, P, T)
    return P, T, K


def _blocks(P: int, T: int, K: int, block_elems: int):
    """Fixed (P, T) block sizes with ``pc · tc · K ≤ block_elems`` (at least one token, one problem)."""
    tc = max(1, min(T, block_elems // max(K, 1)))
    pc = max(1, min(P, block_elems // max(tc * K, 1)))
    return pc, tc


def _masked_block(k, beta, mask, p0, p1, t0, t1, dtype):
    """Block of (k, β) in ``dtype`` with invalid tokens zeroed (their NaN/Inf ignored); checks finiteness."""
    kk = k[p0:p1, t0:t1].to(dtype)
    bb = beta[p0:p1, t0:t1].to(dtype)
    if mask is not None:
        m = mask[p0:p1, t0:t1]
        kk = torch.where(m[..., None], kk, torch.zeros((), dtype=dtype, device=kk.device))
        bb = torch.where(m, bb, torch.zeros((), dtype=dtype, device=bb.device))
    for name, x in (("k", kk), ("beta", bb)):
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"argument {name!r}: expected finite values at every valid token")
    return kk, bb


# -------------------------------------------------------------------------------------- normal equations


def normal_equations(
    k: torch.Tensor,
    beta: torch.Tensor,
    mask: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float64,
    *,
    block_elems: int = BLOCK_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ε_T(d) = ½ dᵀGd − cᵀd + c0`` over the valid tokens of each problem.

    Args:
        k: ``[P, T, K]`` keys (any float dtype; converted block by block).
        beta: ``[P, T]`` gates.
        mask: ``[P, T]`` bool, the valid tokens (``None``: all). Entries at invalid tokens are ignored,
            even NaN/Inf; valid ones must be finite.
        dtype: accumulation dtype (fp64 by default).
        block_elems: largest block (elements) converted at once; the block sizes, hence the summation
            order and the result, depend only on the shapes and this number.

    Returns:
        ``G [P, K, K]`` = AᵀA / T_eff, ``c [P, K]`` = Aᵀ1 / T_eff, ``c0 [P]`` (½, or 0 when T_eff = 0),
        ``T_eff [P]`` (int64), with ``A = diag(β) S`` over the valid tokens, on ``k``'s device.
    """
    P, T, K = _check_stream(k, beta, mask)
    dev = k.device
    G = torch.zeros(P, K, K, dtype=dtype, device=dev)
    c = torch.zeros(P, K, dtype=dtype, device=dev)
    pc, tc = _blocks(P, T, K, block_elems)
    for p0 in range(0, P, pc):
        p1 = min(P, p0 + pc)
        for t0 in range(0, T, tc):
            t1 = min(T, t0 + tc)
            kk, bb = _masked_block(k, beta, mask, p0, p1, t0, t1, dtype)
            A = bb[..., None] * (kk * kk)  # [pc, tc, K]
            G[p0:p1].baddbmm_(A.transpose(1, 2), A)
            c[p0:p1] += A.sum(1)
    T_eff = torch.full((P,), T, dtype=torch.int64, device=dev) if mask is None else mask.sum(1)
    inv = 1.0 / T_eff.clamp_min(1).to(dtype)
    G *= inv[:, None, None]
    c *= inv[:, None]
    c0 = torch.where(T_eff > 0, 0.5, 0.0).to(dtype)
    return G, c, c0, T_eff


def comparator_gap_masked(
    d: torch.Tensor,
    k: torch.Tensor,
    beta: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    dtype: torch.dtype = torch.float64,
    block_elems: int = BLOCK_ELEMS,
) -> torch.Tensor:
    """``ε_T(d) = 1/(2 T_eff) Σ_{t valid} (1 − β_t⟨d, s_t⟩)²`` evaluated from the stream (no cancellation,
    so tiny values keep their relative accuracy); 0 where no token is valid.

    ``d: [P, K]``, ``k: [P, T, K]``, ``beta, mask: [P, T]`` → ``[P]`` in ``dtype``.
    """
    P, T, K = _check_stream(k, beta, mask)
    check_tensor("d", d)
    check_shape("d", d, [P, K], "[P, K]")
    dd = d.to(dtype)
    total = torch.zeros(P, dtype=dtype, device=k.device)
    pc, tc = _blocks(P, T, K, block_elems)
    for p0 in range(0, P, pc):
        p1 = min(P, p0 + pc)
        for t0 in range(0, T, tc):
            t1 = min(T, t0 + tc)
            kk, bb = _masked_block(k, beta, mask, p0, p1, t0, t1, dtype)
            a = bb * torch.bmm(kk * kk, dd[p0:p1, :, None])[..., 0]
            r = 1.0 - a
            if mask is not None:
                r = torch.where(mask[p0:p1, t0:t1], r, torch.zeros((), dtype=dtype, device=r.device))
            total[p0:p1] += (r * r).sum(1)
    T_eff = torch.full((P,), T, device=k.device) if mask is None else mask.sum(1)
    return 0.5 * total / T_eff.clamp_min(1).to(dtype)


# ------------------------------------------------------------------------------------------- the solver


def _quad(G, c, c0, D):
    """Values, gradients and value magnitudes (``|½dᵀGd| + |cᵀd| + |c0|``, the scale of the value's rounding
    error) at candidates ``D: [W, C, K]`` → ``([W, C], [W, C, K], [W, C])``."""
    GD = torch.bmm(D, G)  # G symmetric: (G dᵀ)ᵀ = d G
    grad = GD - c[:, None, :]
    quad, lin = 0.5 * (D * GD).sum(-1), (D * c[:, None, :]).sum(-1)
    return quad - lin + c0[:, None], grad, quad.abs() + lin.abs() + c0.abs()[:, None]


def _floor(mag):
    """Differences of values below this are rounding noise."""
    return 32 * torch.finfo(mag.dtype).eps * mag


def _select(cand, G, c, c0, lo, hi):
    """The candidate of least value; among those within the rounding floor of it, the one of least gap
    (first on ties). ``cand: [W, C, K]`` → ``d [W, K]``, value, gradient, gap, value magnitude."""
    val, grad, mag = _quad(G, c, c0, cand)
    gap = _fw_gap(grad, cand, lo, hi)
    vmin, imin = val.min(1, keepdim=True)
    near = val <= vmin + _floor(mag.gather(1, imin))
    best = torch.where(near, gap, math.inf).argmin(1)
    pick = torch.arange(cand.shape[0], device=cand.device)
    return cand[pick, best], val[pick, best], grad[pick, best], gap[pick, best], mag[pick, best]


def _fw_gap(g, d, lo, hi):
    """``max_{y∈box} gᵀ(d − y) = Σ_i g_i⁺(d_i − lo) + g_i⁻(hi − d_i)`` → ``[...]``."""
    return (g.clamp_min(0) * (d - lo) + (-g).clamp_min(0) * (hi - d)).sum(-1)


def _solve_spd(M, r, mu, free):
    """Solve ``M p = r`` for symmetric PSD ``M`` (rows outside ``free`` are identity rows) by Cholesky of
    ``M + μ·diag(free)`` and two steps of iterative refinement toward the unregularised solution; retries
    with a 1e3× larger μ where Cholesky fails, and gives ``p = 0`` where it still fails."""
    p = torch.zeros_like(r)
    rows = None  # None: every row still to do
    for _ in range(4):
        Mt, rt = (M, r) if rows is None else (M[rows], r[rows])
        reg = Mt.clone()
        reg.diagonal(dim1=-2, dim2=-1).add_(mu[:, None] * free[rows if rows is not None else slice(None)])
        L, info = torch.linalg.cholesky_ex(reg)
        ok = info == 0
        all_ok = bool(ok.all())
        if not all_ok:
            L, Mt, rt = L[ok], Mt[ok], rt[ok]
        pt = torch.cholesky_solve(rt[..., None], L)
        for _ in range(2):
            pt = pt + torch.cholesky_solve(rt[..., None] - torch.bmm(Mt, pt), L)
        done = torch.arange(r.shape[0], device=r.device) if rows is None else rows
        p[done[ok]] = pt[..., 0]
        if all_ok:
            break
        rows, mu = done[~ok], mu[~ok] * 1e3
    return p


def _cauchy_step(G, g):
    """``gᵀg / gᵀGg``, the minimiser along ``−g`` ignoring the box (0 where ``gᵀGg = 0``) → ``[W, 1]``."""
    gGg = (torch.bmm(G, g[..., None])[..., 0] * g).sum(-1, keepdim=True)
    return torch.where(gGg > 0, (g * g).sum(-1, keepdim=True) / gGg.clamp_min(torch.finfo(g.dtype).tiny), 0.0)


def _newton_dir(G, g, free, mu):
    """``p`` with ``G_FF p_F = −g_F`` (regularised Cholesky + refinement) and ``p = 0`` off ``free``."""
    f = free.to(G.dtype)
    M = G * (f[:, :, None] * f[:, None, :])
    M.diagonal(dim1=-2, dim2=-1).add_(1.0 - f)
    return _solve_spd(M, -g * f, mu, f)


def _projected_newton(G, g, d, lo, hi, mu, alphas):
    """Bertsekas' projected Newton path ``Π(d + αp)`` with the ε-active set put on its bounds →
    ``[W, len(alphas), K]``."""
    delta = (d - (d - g).clamp(lo, hi)).abs().amax(-1).clamp_max(0.25 * (hi - lo))[:, None]
    at_lo = (d <= lo + delta) & (g > 0)
    at_hi = (d >= hi - delta) & (g < 0)
    p = _newton_dir(G, g, ~(at_lo | at_hi), mu)
    path = (d[:, None, :] + alphas[None, :, None] * p[:, None, :]).clamp(lo, hi)
    return torch.where(at_lo[:, None, :], lo, torch.where(at_hi[:, None, :], hi, path))


def _active_set_step(G, c, g, d, lo, hi, mu, inner: int = 4, repeats: int = 2):
    """Up to ``inner`` steps of the primal active-set method (Lawson–Hanson / BVLS) → ``[W, 1, K]``.

    Fix the coordinates on a bound whose gradient points out of the box; then repeatedly: solve the
    Newton system on the free ones (re-solving up to ``repeats`` times after fixing free coordinates on a
    bound whose Newton step points outward), move along ``p`` until the first free coordinate meets its
    bound (put exactly on it, and fixed for the next step) or ``τ = 1`` (the face's minimiser: done). The
    value decreases at every step. Unlike the projected path this stays inside the box on the face's
    minimiser set when that set is a flat (rank-deficient ``G_FF``), where the minimum-norm Newton step
    may point out of the box.
    """
    x = d.clone()
    free = ~(((x == lo) & (g > 0)) | ((x == hi) & (g < 0)))
    rows = torch.arange(x.shape[0], device=x.device)  # rows still moving
    gx = g
    for _ in range(inner):
        Gr, xr, fr, mur = G[rows], x[rows], free[rows], mu[rows]
        p = _newton_dir(Gr, gx, fr, mur)
        for _ in range(repeats):
            bad = fr & (((xr == lo) & (p < 0)) | ((xr == hi) & (p > 0)))
            redo = bad.any(-1)
            if not bool(redo.any()):
                break
            fr = fr & ~bad
            p[redo] = _newton_dir(Gr[redo], gx[redo], fr[redo], mur[redo])
        inf = torch.full_like(p, math.inf)
        room = torch.where(p > 0, (hi - xr) / p, torch.where(p < 0, (lo - xr) / p, inf)).clamp_min(0)
        tau = room.amin(-1, keepdim=True).clamp_max(1.0)
        step = (xr + tau * p).clamp(lo, hi)
        hit = (room <= tau) & (tau < 1)
        x[rows] = torch.where(hit & (p > 0), hi, torch.where(hit & (p < 0), lo, step))
        free[rows] = fr & ~hit
        blocked = tau[:, 0] < 1
        rows = rows[blocked]
        if rows.numel() == 0:
            break
        gx = torch.bmm(G[rows], x[rows, :, None])[..., 0] - c[rows]
    return x[:, None, :]


def _check_qp(G, c, c0, d_init, lo, hi):
    check_tensor("G", G)
    if G.dim() != 3:
        check_shape("G", G, [None] * 3, "[P, K, K]")
    P, K = G.shape[:2]
    check_shape("G", G, [P, K, K], "[P, K, K]")
    check_tensor("c", c)
    check_shape("c", c, [P, K], "[P, K]")
    check_tensor("c0", c0)
    check_shape("c0", c0, [P], "[P]")
    named = [("G", G), ("c", c), ("c0", c0)]
    if d_init is not None:
        check_tensor("d_init", d_init)
        check_shape("d_init", d_init, [P, K], "[P, K]")
        named.append(("d_init", d_init))
    for name, x in named:
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"argument {name!r}: expected finite values")
    return P, K


def solve_box_lsq(
    G: torch.Tensor,
    c: torch.Tensor,
    c0: torch.Tensor,
    *,
    d_min: float,
    d_max: float,
    tol: float = 1e-10,
    max_iter: int = 100,
    d_init: torch.Tensor | None = None,
) -> BoxLSQResult:
    """Minimise ``½ dᵀGd − cᵀd + c0`` over ``[d_min, d_max]^K`` for ``P`` problems at once (gradient
    projection with Newton steps on the faces, see the module docstring).

    Args:
        G: ``[P, K, K]`` symmetric positive semidefinite (singular allowed).
        c: ``[P, K]``; c0: ``[P]``.
        d_min, d_max: the box, ``0 < d_min ≤ d_max`` (finite).
        tol: stop a problem once its certified gap is ``≤ tol · (1 + value)``.
        max_iter: iterations at most (0: only evaluate the certificates at ``d_init``).
        d_init: ``[P, K]`` starting point (projected onto the box); default ``Π_box(1)``.

    Returns:
        :class:`BoxLSQResult`; value, gap and residual are evaluated from ``(G, c, c0)`` in G's dtype.
    """
    lo, hi = _check_box_finite(d_min, d_max)
    P, K = _check_qp(G, c, c0, d_init, lo, hi)
    c, c0 = c.to(G.dtype), c0.to(G.dtype)
    d = (torch.ones_like(c) if d_init is None else d_init.to(G.dtype)).clamp(lo, hi)
    diag = G.diagonal(dim1=-2, dim2=-1)
    mu_all = 1e-12 * diag.amax(-1).clamp_min(torch.finfo(G.dtype).tiny)
    L_all = G.abs().sum(-1).amax(-1).clamp_min(torch.finfo(G.dtype).tiny)  # ≥ λ_max(G)
    alphas = 2.0 ** -torch.arange(_N_LINE_SEARCH, dtype=G.dtype, device=G.device)
    steps = 2.0 ** torch.arange(_N_CAUCHY, dtype=G.dtype, device=G.device)  # × 1/L

    val, g, _ = (x[:, 0] for x in _quad(G, c, c0, d[:, None, :]))
    gap = _fw_gap(g, d, lo, hi)
    work = torch.arange(P, device=G.device)
    iterations = 0
    while iterations < max_iter:
        work = work[gap[work] > tol * (1.0 + val[work].abs())]
        if work.numel() == 0:
            break
        iterations += 1
        Gw, cw, c0w, dw, gw, mu = G[work], c[work], c0[work], d[work], g[work], mu_all[work]
        # 1. Cauchy point: the best point of the projected-gradient path Π(d − t g), t ≥ 1/L.
        t = torch.cat([steps[None, :] / L_all[work, None], _cauchy_step(Gw, gw)], dim=1)  # [W, C1]
        path = (dw[:, None, :] - t[..., None] * gw[:, None, :]).clamp(lo, hi)
        dc, _, gc, _, _ = _select(torch.cat([dw[:, None, :], path], dim=1), Gw, cw, c0w, lo, hi)
        # 2. Newton on the face of the Cauchy point: truncated (active-set) step and projected path.
        cand = torch.cat(
            [
                dc[:, None, :],
                _active_set_step(Gw, cw, gc, dc, lo, hi, mu),
                _projected_newton(Gw, gc, dc, lo, hi, mu, alphas),
            ],
            dim=1,
        )
        dn, vn, gn, gapn, magn = _select(cand, Gw, cw, c0w, lo, hi)
        progress = (vn < val[work] - _floor(magn)) | (gapn < gap[work])
        d[work], val[work], g[work], gap[work] = dn, vn, gn, gapn
        work = work[progress]  # neither the value nor the gap moved: the rounding floor, stop

    kkt = (d - (d - g).clamp(lo, hi)).abs().amax(-1) if K else torch.zeros_like(val)
    return BoxLSQResult(
        d=d,
        value=val,
        kkt_residual=kkt,
        gap=gap,
        iterations=iterations,
        converged=gap <= tol * (1.0 + val.abs()),
    )


def comparator_gap_diag(
    k: torch.Tensor,
    beta: torch.Tensor,
    *,
    d_min: float = 0.5,
    d_max: float = 2.0,
    mask: torch.Tensor | None = None,
    tol: float = 1e-10,
    max_iter: int = 100,
    dtype: torch.dtype = torch.float64,
    block_elems: int = BLOCK_ELEMS,
) -> BoxLSQResult:
    """``ε_T^diag = min_{d∈[d_min,d_max]^K} ε_T(d)`` over the valid tokens of each of ``P`` streams.

    Args:
        k: ``[P, T, K]`` keys; beta: ``[P, T]``; mask: ``[P, T]`` bool valid tokens (``None``: all).
        d_min, d_max: the box; tol, max_iter: as :func:`solve_box_lsq`; dtype, block_elems: as
            :func:`normal_equations`.

    Returns:
        :class:`BoxLSQResult` (on ``k``'s device, in ``dtype``). ``value`` is re-evaluated from the
        stream by :func:`comparator_gap_masked` (≥ 0, accurate also when tiny); ``gap`` and
        ``kkt_residual`` come from the normal equations. Problems without a valid token have value 0,
        gap 0 and ``d = Π_box(1)``.
    """
    lo, hi = _check_box_finite(d_min, d_max)
    G, c, c0, _ = normal_equations(k, beta, mask, dtype, block_elems=block_elems)
    res = solve_box_lsq(G, c, c0, d_min=lo, d_max=hi, tol=tol, max_iter=max_iter)
    res.value = comparator_gap_masked(res.d, k, beta, mask, dtype=dtype, block_elems=block_elems)
    return res
