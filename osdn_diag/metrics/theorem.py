"""Theorem D.7 (= Thm 5.2) checked on captured streams: one row of ``comparator.parquet`` per problem.

A *problem* is one (prompt, layer, head) stream: keys ``k_t``, gates ``β_t``, the preconditioner ``d_t``
used at each token (``d_t ≡ 1`` for plain DeltaNet) and the measured residual ratios ``q_t`` from replay.

**Valid tokens.** The theorem is false as written at tokens with zero residual ``u_t = 0``, where the
paper sets ``q_t = 1`` (claims ledger: ``thm-d7-zero-residual-convention``). Everything here — the
product of ratios, ``ε_T``, ``R_T`` and ``T`` itself — runs over the *valid* tokens only (``u_t ≠ 0``,
finite; the caller's ``valid`` mask), with ``T_eff = n_valid``; the excluded tokens contribute the factor
1 to the product. Inputs at invalid tokens are ignored, even NaN/Inf.

**Columns** (per problem, over valid tokens; ``s_t = k_t ⊙ k_t``, ``n_t = ‖k_t‖²``, ``a_t(d) = β_t⟨d, s_t⟩``):

* ``eps_diag`` — ``ε_T^diag = min_{d∈box} ε_T(d)`` with ``ε_T(d) = 1/(2T_eff) Σ (1 − a_t(d))²``, attained at
  ``d*`` (the solver of :func:`~osdn_diag.metrics.comparator.comparator_gap_diag`, started from the
  unconstrained minimiser of ``eps_free`` projected onto the box); ``kkt_residual`` and ``gap`` are
  the solver's certificates (``gap`` bounds ``eps_diag − min`` from above);
* ``eps_at_ones`` — ``ε_T(1)``; ``eps_at_final_d`` — ``ε_T(d_T)``, the preconditioner used at the last
  position of the stream (valid or not);
* ``regret`` — ``R_T(d*) = Σ h_t(d_t) − h_t(d*)``, ``h_t(d) = ((1 − a_t(d))² − 1)/(2 n_t)`` with the exact
  ``n_t`` (:func:`~osdn_diag.math.closed_forms.surrogate`; a token with ``k_t = 0`` contributes 0 —
  nothing is written there and ``q_t = 1 = 1 + 2 n_t h_t`` for any ``h_t``);
* ``log_prod_q`` — ``Σ log q_t`` (``-inf`` if some ``q_t = 0``); ``log_bound`` —
  ``T_eff · log(2 ε_T(d*) + 2 R_T(d*)/T_eff)`` (:func:`~osdn_diag.math.closed_forms.log_bound`: ``-inf``
  for a zero base, NaN for a negative one); ``slack = log_bound − log_prod_q`` (0 when both are
  ``-inf``: ``0 ≤ 0`` holds with equality);
* ``n_valid``, ``max_unit_dev = max |n_t − 1|``, ``beta_min``, ``beta_max`` (NaN without valid tokens),
  ``d_in_box`` (every ``d_t`` at a valid token inside the box), ``share_newton_infeasible`` (share of
  valid tokens with ``β_t < 1/d_max``: there ``a_t(d) ≤ β_t d_max ‖k_t‖² < 1`` under unit keys, so the
  gated Newton condition ``a_t(d) = 1`` of the super-geometric corollary is impossible);
* ``eps_free`` — ``min_{d∈R^K} ε_T(d)``, the unconstrained least-squares gap (d from the normal
  equations by an eigendecomposition with small eigenvalues cut, ε re-evaluated from the stream), and
  ``newton_feasible`` / ``newton_feasible_box`` — whether the gated Newton system ``β_t⟨d, s_t⟩ = 1``
  for every valid token has a solution in ``R^K`` / in the box, to within ``ε ≤ NEWTON_TOL`` (from
  ``eps_free`` / ``eps_diag``; false without valid tokens). With unit keys it is ``T_eff`` equations in
  ``K`` unknowns: over-determined once ``T_eff > K``, and then solvable only off generic streams
  (ledger ``thm-5.2-newton-overdetermined``), so Theorem 5.2's super-geometric clause rarely applies;
* ``key_norm_tol``, ``unit_keys``, ``beta_in_open_unit_interval``, ``no_decay`` and ``hypotheses_hold``
  — the stream's checks of Theorem D.7's hypotheses and whether all hold, as defined once in
  :mod:`osdn_diag.metrics.hypotheses` (with ``d_in_box`` and ``n_valid ≥ 1``): unit keys up to the
  key-norm tolerance of the dtype the keys were read in, ``β_t ∈ (0, 1)``, ``d`` in the box, not gated
  (Lemma 4.1's ``q_t = (1 − a_t)²`` needs the ratio against the undecayed state), a valid token.
  Problems with no valid token get ``log_prod_q = log_bound = slack = 0`` (empty product ≤ 1).

**What the bound says here.** With unit keys, ``2 ε_T(d) + 2 R_T(d)/T = mean_t (1 − a_t(d_t))²`` for
*every* comparator ``d`` (ledger: ``thm-d7-realised-regret-identity``), and Lemma 4.1 makes that the mean
of the ``q_t``. With the realised regret the bound is therefore exactly AM–GM, ``Π q_t ≤ (mean q_t)^T``:
``slack ≥ 0`` is guaranteed whenever the hypotheses hold, up to rounding and up to the key-norm
tolerance (with ``n_t = 1 + δ_t`` the identity is off by ``O(max |δ_t|)`` per token). A negative slack
with ``hypotheses_hold`` is a measurement problem, not news about the theorem. The informative numbers are
``eps_diag`` (how well *any* diagonal preconditioner in the box could do), the regret (how far the online
iterates are from it) and the size of the slack (how far the ratios are from all being equal).
"""

from __future__ import annotations

import torch

from ..runtime.checks import check_shape, check_tensor
from ..math.closed_forms import log_bound as _log_bound
from ..math.closed_forms import surrogate
from . import hypotheses
from .comparator import (
    BLOCK_ELEMS,
    BoxLSQResult,
    _check_box_finite,
    _check_mask,
    comparator_gap_masked,
    normal_equations,
    solve_box_lsq,
)

__all__ = ["COLUMNS", "NEWTON_TOL", "theorem_d7"]

#: the columns :func:`theorem_d7` returns, in order
COLUMNS = (
    "eps_diag",
    "kkt_residual",
    "gap",
    "eps_at_ones",
    "eps_at_final_d",
    "regret",
    "log_prod_q",
    "log_bound",
    "slack",
    "n_valid",
    "max_unit_dev",
    "beta_min",
    "beta_max",
    "d_in_box",
    "share_newton_infeasible",
    "eps_free",
    "newton_feasible",
    "newton_feasible_box",
    "key_norm_tol",
    "unit_keys",
    "beta_in_open_unit_interval",
    "no_decay",
    "hypotheses_hold",
)

#: Largest ε_T at which the gated Newton system counts as solved: ε = ½·mean (1 − β_t⟨d, s_t⟩)², so
#: 1e-9 is a root-mean-square equation residual of 4.5e-5 — far below what separates a generic
#: over-determined stream (ε ~ 1e-3 at K = 16, T = 32) from a solvable one (ε at rounding level), and
#: above the box solver's stopping accuracy (its gap ≤ 1e-10 · (1 + ε)).
NEWTON_TOL = 1e-9
#: Eigenvalues of the normal-equation matrix below this fraction of its largest are treated as zero
#: when solving for the unconstrained d (the pseudo-inverse of a rank-deficient system, T_eff < K).
_EIG_RTOL = 1e-13
#: A Cholesky solve is trusted where its smallest pivot is at least this fraction of its largest (so
#: cond(G) is moderate, and d is accurate to far better than the ε it is used to evaluate); the other
#: problems take the eigendecomposition.
_CHOL_RTOL = 1e-8

F64 = torch.float64


def _validate(k, beta, d_traj, q, valid, gated):
    check_tensor("k", k)
    if k.dim() != 3:
        check_shape("k", k, [None] * 3, "[P, T, K]")
    P, T, K = k.shape
    for name, x in (("beta", beta), ("q", q)):
        check_tensor(name, x)
        check_shape(name, x, [P, T], "[P, T]")
    if d_traj is not None:
        check_tensor("d_traj", d_traj)
        check_shape("d_traj", d_traj, [P, T, K], "[P, T, K]")
    _check_mask(valid, P, T, "valid")
    if isinstance(gated, torch.Tensor):
        if gated.dtype != torch.bool:
            raise ValueError(f"argument 'gated': expected a bool or a bool tensor [P], got {gated.dtype}")
        check_shape("gated", gated, [P], "[P]")
    elif not isinstance(gated, bool):
        raise ValueError(f"argument 'gated': expected a bool or a bool tensor [P], got {type(gated).__name__}")
    return P, T, K


def _check_unit_tol(unit_tol, k: torch.Tensor, P: int) -> torch.Tensor:
    """``unit_tol`` as a ``[P]`` fp64 tensor on ``k``'s device (see :func:`theorem_d7`)."""
    if unit_tol is None:
        unit_tol = hypotheses.key_norm_tol(str(k.dtype).removeprefix("torch."))
    if isinstance(unit_tol, torch.Tensor):
        if unit_tol.dim() != 1 or unit_tol.shape[0] != P or unit_tol.is_complex() or unit_tol.dtype == torch.bool:
            raise ValueError(f"argument 'unit_tol': expected a number or a real tensor [P] = [{P}], "
                             f"got {unit_tol.dtype} {list(unit_tol.shape)}")
        tol = unit_tol.to(device=k.device, dtype=F64)
    elif isinstance(unit_tol, (int, float)) and not isinstance(unit_tol, bool):
        tol = torch.full((P,), float(unit_tol), dtype=F64, device=k.device)
    else:
        raise ValueError(f"argument 'unit_tol': expected a number >= 0, got {unit_tol!r}")
    if not bool(((tol >= 0) & torch.isfinite(tol)).all()):
        raise ValueError(f"argument 'unit_tol': expected numbers >= 0, got {unit_tol!r}")
    return tol


def _valid_only(name, x, m):
    """``x`` in fp64 with invalid tokens zeroed; ValueError naming ``name`` if a valid entry is not finite."""
    x = x.to(F64)
    mm = m if x.dim() == m.dim() else m[..., None]
    x = torch.where(mm, x, torch.zeros((), dtype=F64, device=x.device))
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"argument {name!r}: expected finite values at every valid token")
    return x


def _free_minimiser(G: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``argmin_d ½dᵀGd − cᵀd`` over ``R^K`` for ``G [P, K, K]`` ⪰ 0 (the minimum-norm one where ``G`` is
    singular). A batched Cholesky solve where ``G`` is well conditioned — every problem of a long stream
    of varied keys — and an eigendecomposition with small eigenvalues cut for the others (fewer tokens
    than keys, repeated or one-hot keys): on a GPU the batched eigendecomposition costs about 1.6 ms a
    problem at K = 128 (14.5 s for 9,216 problems on an H200, the Cholesky solve 0.02 s)."""
    G, c = G.to(F64), c.to(F64)
    d = torch.zeros_like(c)
    if G.shape[0] == 0:
        return d
    L, info = torch.linalg.cholesky_ex(G)
    pivots = torch.diagonal(L, dim1=-2, dim2=-1).square()  # LDLᵀ's pivots: their spread bounds cond(G) below
    well = (info == 0) & (pivots.amin(-1) > _CHOL_RTOL * pivots.amax(-1))
    if bool(well.any()):
        d[well] = torch.cholesky_solve(c[well, :, None], L[well])[..., 0]
    if not bool(well.all()):
        d[~well] = _eig_minimiser(G[~well], c[~well])
    return d


def _eig_minimiser(G: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``G⁺c`` by an eigendecomposition, eigenvalues below :data:`_EIG_RTOL` of the largest cut."""
    lam, Q = torch.linalg.eigh(G)
    keep = lam > _EIG_RTOL * lam.amax(-1, keepdim=True).clamp_min(torch.finfo(F64).tiny)
    w = (Q.transpose(-1, -2) @ c[..., None])[..., 0]
    w = torch.where(keep, w / torch.where(keep, lam, 1.0), 0.0)
    return (Q @ w[..., None])[..., 0]


def _chunk(k, beta, d_traj, q, m, gated, lo, hi, unit_tol, res: BoxLSQResult, d_free) -> dict[str, torch.Tensor]:
    """Every column for a group of problems whose comparator ``res`` (``d*``, its certificates) is
    solved; ``res.value`` is re-evaluated here from the stream."""
    P, T, K = k.shape
    nan = torch.full((P,), float("nan"), dtype=F64, device=k.device)
    kk, bb, qq = _valid_only("k", k, m), _valid_only("beta", beta, m), _valid_only("q", q, m)
    dt = torch.ones_like(kk) if d_traj is None else _valid_only("d_traj", d_traj, m)
    if bool((qq < 0).any()):
        raise ValueError("argument 'q': expected ratios >= 0 at every valid token")
    n_valid = m.sum(1)
    has = n_valid > 0

    res.value = comparator_gap_masked(res.d, kk, bb, m)
    d_star = res.d
    ones = torch.ones(P, K, dtype=F64, device=k.device)
    final = ones if T == 0 or d_traj is None else d_traj[:, -1].to(F64)
    eps_at_final_d = comparator_gap_masked(final, kk, bb, m)

    n = (kk * kk).sum(-1)  # [P, T]
    use = m & (n > 0)
    h_alg = surrogate(dt, kk, bb)
    h_cmp = surrogate(d_star[:, None, :].expand_as(dt), kk, bb)
    regret = torch.where(use, h_alg - h_cmp, 0.0).sum(1)

    log_prod_q = torch.where(m, qq.log(), 0.0).sum(1)
    T_eff = n_valid.clamp_min(1).to(F64)
    log_bound = torch.where(has, _log_bound(res.value, regret, T_eff), 0.0)
    both_zero = torch.isneginf(log_bound) & torch.isneginf(log_prod_q)
    slack = torch.where(both_zero, 0.0, log_bound - log_prod_q)

    max_unit_dev = torch.where(has, torch.where(m, (n - 1.0).abs(), -1.0).amax(1) if T else nan, nan)
    beta_min = torch.where(has, torch.where(m, bb, float("inf")).amin(1) if T else nan, nan)
    beta_max = torch.where(has, torch.where(m, bb, float("-inf")).amax(1) if T else nan, nan)
    inside = ((dt >= lo) & (dt <= hi)).all(-1) | ~m
    d_in_box = inside.all(1)
    infeasible = (m & (bb < 1.0 / hi)).sum(1).to(F64)
    share_newton_infeasible = torch.where(has, infeasible / T_eff, nan)
    eps_free = torch.where(has, comparator_gap_masked(d_free, kk, bb, m), nan)
    flags = hypotheses.check(n_valid, max_unit_dev, beta_min, beta_max, d_in_box, gated, unit_tol)
    return {
        "eps_diag": res.value,
        "kkt_residual": res.kkt_residual,
        "gap": res.gap,
        "eps_at_ones": comparator_gap_masked(ones, kk, bb, m),
        "eps_at_final_d": eps_at_final_d,
        "regret": regret,
        "log_prod_q": log_prod_q,
        "log_bound": log_bound,
        "slack": slack,
        "n_valid": n_valid,
        "max_unit_dev": max_unit_dev,
        "beta_min": beta_min,
        "beta_max": beta_max,
        "d_in_box": d_in_box,
        "share_newton_infeasible": share_newton_infeasible,
        "eps_free": eps_free,
        "newton_feasible": has & (eps_free <= NEWTON_TOL),
        "newton_feasible_box": has & (res.value <= NEWTON_TOL),
        "key_norm_tol": unit_tol.clone(),
        **{name: flags[name] for name in ("unit_keys", "beta_in_open_unit_interval", "no_decay", "hypotheses_hold")},
    }


def theorem_d7(
    k: torch.Tensor,
    beta: torch.Tensor,
    d_traj: torch.Tensor | None,
    q: torch.Tensor,
    valid: torch.Tensor,
    *,
    d_min: float = 0.5,
    d_max: float = 2.0,
    gated: bool | torch.Tensor = False,
    unit_tol: float | torch.Tensor | None = None,
    solver_kw: dict | None = None,
    block_elems: int = BLOCK_ELEMS,
) -> dict[str, torch.Tensor]:
    """Theorem D.7's quantities for ``P`` streams; see the module docstring for every column.

    Args:
        k: ``[P, T, K]`` keys as the state kernel reads them.
        beta: ``[P, T]`` gates β_t.
        d_traj: ``[P, T, K]`` the preconditioner used at each token; ``None`` means ones (plain DeltaNet).
        q: ``[P, T]`` measured residual ratios ``f_t(S_t) / f_t(S_{t−1})``.
        valid: ``[P, T]`` bool, tokens with ``u_t ≠ 0`` and finite measurements.
        d_min, d_max: the comparator box (and the box ``d_t`` must stay in).
        gated: whether the layer decays its state (bool, or a bool tensor ``[P]``).
        unit_tol: largest ``|‖k_t‖² − 1|`` that still counts as a unit key: a number, or a ``[P]``
            tensor (one per problem); by default
            :func:`~osdn_diag.metrics.hypotheses.key_norm_tol` of ``k``'s dtype — pass the dtype the
            kernel read its keys in where ``k`` was converted since (the replay does).
        solver_kw: extra keywords for :func:`~osdn_diag.metrics.comparator.comparator_gap_diag`
            (``tol``, ``max_iter``, ``dtype``, ``block_elems``).
        block_elems: problems are processed in groups of about this many ``T·K`` elements.

    Returns:
        ``{column: [P] tensor}`` in :data:`COLUMNS` order: fp64 values, ``n_valid`` int64,
        ``d_in_box``, ``newton_feasible``, ``newton_feasible_box``, ``unit_keys``,
        ``beta_in_open_unit_interval``, ``no_decay`` and ``hypotheses_hold`` bool; on ``k``'s device.
    """
    lo, hi = _check_box_finite(d_min, d_max)
    P, T, K = _validate(k, beta, d_traj, q, valid, gated)
    unit_tol = _check_unit_tol(unit_tol, k, P)
    if isinstance(gated, torch.Tensor):
        gated_t = gated.to(k.device)
    else:
        gated_t = torch.full((P,), gated, device=k.device)
    solver_kw = dict(solver_kw or {})
    dtype = solver_kw.pop("dtype", F64)
    block_elems = solver_kw.pop("block_elems", block_elems)
    # One solve for every problem (the solver's cost is per iteration, not per problem), then the
    # stream-side columns group by group.
    G, c, c0, _ = normal_equations(k, beta, valid, dtype, block_elems=block_elems)
    d_free = _free_minimiser(G, c) if P else G.new_zeros(0, K)
    # The box solver starts from the unconstrained minimiser projected onto the box, which it needs
    # for eps_free anyway: on the paper's streams that takes it to the certified minimum in fewer
    # iterations (each a few hundred kernel launches) than its default start at d = 1.
    solver_kw.setdefault("d_init", d_free.to(G.dtype).clamp(lo, hi))
    sol = solve_box_lsq(G, c, c0, d_min=lo, d_max=hi, **solver_kw)
    pc = max(1, block_elems // max(T * K, 1))
    parts = []
    for p0 in range(0, max(P, 1), pc):
        sl = slice(p0, min(P, p0 + pc))
        res = BoxLSQResult(d=sol.d[sl], value=sol.value[sl], kkt_residual=sol.kkt_residual[sl], gap=sol.gap[sl],
                           iterations=sol.iterations, converged=sol.converged[sl])
        dt = None if d_traj is None else d_traj[sl]
        parts.append(_chunk(k[sl], beta[sl], dt, q[sl], valid[sl], gated_t[sl], lo, hi, unit_tol[sl], res,
                            d_free[sl]))
    return {name: torch.cat([p[name] for p in parts]) for name in COLUMNS}
