"""The box-constrained least-squares solver behind ε_T^diag, against scipy's ``lsq_linear`` on fresh random
problems, and its certificates (the Frank–Wolfe gap must be a true upper bound on the suboptimality).

Reference: for each problem, ``A = diag(β) S / √T_eff`` over the valid tokens and ``b = 1/√T_eff``, so
``ε_T(d) = ½‖Ad − b‖²``; scipy solves it with BVLS and with TRF, and the better of the two, scored at the
clipped point by :func:`eps_written_out` (the objective written out here in numpy, sharing no code with
the package), is the reference value ``v_ref ≥ min ε_T``. The package's reported value is scored the
same way at its own ``d``.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.optimize import lsq_linear

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "math"))  # shared strategies
from osdn_strategies import BETA_HI, BETA_LO, betas, floats_in, keys, rng, seeds  # noqa: E402

from osdn_diag.math import comparator_gap  # noqa: E402
from osdn_diag.metrics.comparator import (  # noqa: E402
    comparator_gap_diag,
    comparator_gap_masked,
    normal_equations,
    solve_box_lsq,
)

F64 = torch.float64
REL, ABS = 1e-10, 1e-14  # the solver's tol: value ≤ v_ref + REL (1 + v_ref) + ABS


# ------------------------------------------------------------------------------------------- helpers


def eps_written_out(d, k, beta, mask=None) -> float:
    """``ε_T(d) = 1/(2 T_eff) Σ_{t valid} (1 − β_t Σ_i d_i k_ti²)²`` for one problem, in numpy fp64 with
    an exactly rounded sum; 0 when no token is valid (invalid tokens are dropped before any arithmetic,
    so their NaN/Inf never enter). ``d [K]``, ``k [T, K]``, ``beta [T]``, ``mask [T]`` bool or None."""
    d, k, beta = (np.asarray(a, dtype=np.float64) for a in (d, k, beta))
    if mask is not None:
        keep = np.asarray(mask, dtype=bool)
        k, beta = k[keep], beta[keep]
    if beta.size == 0:
        return 0.0
    residual = 1.0 - beta * ((k * k) @ d)
    return 0.5 * math.fsum(residual * residual) / beta.size


def scipy_value(k, beta, mask, lo, hi) -> torch.Tensor:
    """Reference values ``[P]`` (see the module docstring)."""
    P, T, K = k.shape
    out = torch.zeros(P, dtype=F64)
    for i in range(P):
        m = torch.ones(T, dtype=torch.bool) if mask is None else mask[i]
        n = int(m.sum())
        if n == 0:
            continue
        if lo == hi:  # scipy wants lo < hi; the box is one point
            out[i] = eps_written_out(np.full(K, lo), k[i], beta[i], m)
            continue
        A = (beta[i][m][:, None] * k[i][m] ** 2).numpy() / np.sqrt(n)
        b = np.full(n, 1.0 / np.sqrt(n))
        best = np.inf
        for method in ("bvls", "trf"):
            x = lsq_linear(A, b, bounds=(lo, hi), method=method, tol=1e-14, lsq_solver="exact").x
            best = min(best, eps_written_out(np.clip(x, lo, hi), k[i], beta[i], m))
        out[i] = best
    return out


def assert_value_is_eps_at_d(res, k, beta, mask):
    """The reported value is ε_T at the reported d (scored by :func:`eps_written_out`)."""
    for i in range(k.shape[0]):
        m = None if mask is None else mask[i]
        want = eps_written_out(res.d[i], k[i], beta[i], m)
        assert math.isclose(float(res.value[i]), want, rel_tol=1e-12, abs_tol=1e-14), (i, float(res.value[i]), want)


def check_against_scipy(res, k, beta, mask, lo, hi):
    assert_value_is_eps_at_d(res, k, beta, mask)
    ref = scipy_value(k, beta, mask, lo, hi)
    # The solver's promise: value − min ≤ gap ≤ tol·(1 + value), tol = REL.
    assert (res.value <= ref + REL * (1 + ref.abs()) + ABS).all(), (res.value - ref, res.gap)
    # 1e-12 (1 + v_ref): the two scorers' rounding (package: blocked fp64 sums; here: exact sums)
    assert (res.gap >= res.value - ref - 1e-12 * (1 + ref.abs())).all(), (res.gap, res.value - ref)
    assert (res.gap >= 0).all()
    # Per coordinate kkt_i = min(|g_i|, dist_i) and gap_i = |g_i|·dist_i, so kkt² ≤ gap always, and no
    # absolute bound beyond it: a certified gap of 1e-10 allows a gradient of 1e-7 along a nearly flat
    # direction (tests/metrics/test_theorem.py met one), or a large one in a box a hair wide.
    assert (res.kkt_residual**2 <= res.gap * (1 + 1e-9) + 1e-300).all(), (res.kkt_residual, res.gap)
    assert res.converged.all()
    assert ((res.d >= lo) & (res.d <= hi)).all()
    return ref


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)


def problem(seed, P=6, T=40, K=6, unit_keys=True, beta_range=(0.0, 1.0), p_invalid=0.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(P, T, K, generator=g, dtype=F64)
    k = unit(k) if unit_keys else k * torch.exp(torch.randn(P, 1, K, generator=g, dtype=F64))
    lo_b, hi_b = beta_range
    beta = lo_b + (hi_b - lo_b) * torch.rand(P, T, generator=g, dtype=F64)
    mask = None if p_invalid == 0 else torch.rand(P, T, generator=g) >= p_invalid
    return k, beta, mask


# ----------------------------------------------------------------------------- scenarios against scipy

SCENARIOS = {
    "unit keys": dict(),
    "non-unit keys": dict(unit_keys=False),
    "T < K (rank deficient)": dict(T=4, K=9),
    "T = 1": dict(T=1, K=5),
    "beta near 0": dict(beta_range=(1e-6, 1e-3)),
    "beta near 1": dict(beta_range=(1 - 1e-3, 1 - 1e-6)),
    "all beta = 0 (G = 0)": dict(beta_range=(0.0, 0.0)),
    "some invalid tokens": dict(p_invalid=0.4),
    "K = 16, T = 200": dict(K=16, T=200, P=3),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("box", [(0.5, 2.0), (0.1, 10.0), (0.9, 1.1)])
def test_matches_scipy(name, box):
    for seed in range(3):
        k, beta, mask = problem(seed, **SCENARIOS[name])
        res = comparator_gap_diag(k, beta, d_min=box[0], d_max=box[1], mask=mask)
        check_against_scipy(res, k, beta, mask, *box)


def test_all_invalid_problem_has_value_zero_and_gap_zero():
    k, beta, _ = problem(0, P=3)
    mask = torch.ones(3, k.shape[1], dtype=torch.bool)
    mask[1] = False
    k[1, 0, 0] = float("nan")  # ignored: the token is invalid
    res = comparator_gap_diag(k, beta, mask=mask)
    assert res.value[1] == 0 and res.gap[1] == 0 and res.kkt_residual[1] == 0 and res.converged[1]
    assert ((res.d[1] >= 0.5) & (res.d[1] <= 2.0)).all()
    check_against_scipy(res, k, beta, mask, 0.5, 2.0)
    G, c, c0, T_eff = normal_equations(k, beta, mask)
    assert T_eff.tolist() == [k.shape[1], 0, k.shape[1]]
    assert (G[1] == 0).all() and (c[1] == 0).all() and c0[1] == 0


def test_interior_optimum_is_the_unconstrained_least_squares_solution():
    """β_t = 1/⟨d_true, s_t⟩ · (1 + noise) with d_true well inside the box: the least-squares solution is
    near d_true, the box does not bind and the value is the unconstrained one."""
    g = torch.Generator().manual_seed(1)
    P, T, K = 4, 200, 5
    k = unit(torch.randn(P, T, K, generator=g, dtype=F64))
    d_true = 0.8 + 0.4 * torch.rand(P, K, generator=g, dtype=F64)
    beta = (1 + 0.05 * torch.randn(P, T, generator=g, dtype=F64)) / ((k * k) @ d_true[..., None])[..., 0]
    res = comparator_gap_diag(k, beta, d_min=0.5, d_max=2.0)
    for i in range(P):
        A = (beta[i, :, None] * k[i] ** 2).numpy()
        x = np.linalg.lstsq(A, np.ones(T), rcond=None)[0]
        assert ((x > 0.5) & (x < 2.0)).all()
        v = 0.5 * np.mean((1 - A @ x) ** 2)
        assert res.value[i].item() == pytest.approx(v, rel=1e-10, abs=1e-15)
        torch.testing.assert_close(res.d[i], torch.from_numpy(x), rtol=1e-7, atol=1e-9)
    check_against_scipy(res, k, beta, None, 0.5, 2.0)


def test_binding_box():
    """Small β wants d ≫ d_max: every coordinate ends on the upper face, above the unconstrained value."""
    k, beta, _ = problem(2, beta_range=(0.05, 0.1))
    res = comparator_gap_diag(k, beta, d_min=0.5, d_max=2.0)
    assert (res.d == 2.0).all()
    for i in range(k.shape[0]):
        A = (beta[i, :, None] * k[i] ** 2).numpy()
        x = np.linalg.lstsq(A, np.ones(k.shape[1]), rcond=None)[0]
        assert res.value[i].item() > 0.5 * np.mean((1 - A @ x) ** 2) + 1e-6
    check_against_scipy(res, k, beta, None, 0.5, 2.0)


def test_degenerate_box_and_dead_channels():
    k, beta, _ = problem(3, K=4)
    k[:, :, 2] = 0.0  # a channel no token uses: G has a zero row, d_2 is free and irrelevant
    res = comparator_gap_diag(k, beta, d_min=1.5, d_max=1.5)
    assert (res.d == 1.5).all() and (res.gap == 0).all()
    res = comparator_gap_diag(k, beta)
    check_against_scipy(res, k, beta, None, 0.5, 2.0)


# ------------------------------------------------------------------------------------ random structure


@st.composite
def box_problems(draw):
    P, T, K = draw(st.integers(1, 3)), draw(st.integers(0, 12)), draw(st.integers(1, 6))
    scale = draw(st.sampled_from([1.0, 3.0]), label="key scale")
    k = draw(keys((P, T, K), kinds=("random", "unit", "onehot", "zero"), scale=scale))
    beta_lo = draw(st.sampled_from([BETA_LO, 0.0]), label="beta min")
    beta = draw(betas((P, T), lo=beta_lo, hi=draw(st.sampled_from([BETA_HI, 1.0]), label="beta max")))
    p_invalid = draw(st.sampled_from([0.0, 0.0, 0.3, 1.0]), label="share invalid")
    mask = None
    if p_invalid:
        mask = torch.rand(P, T, generator=rng(draw(seeds), salt=7), dtype=F64) >= p_invalid
    lo = draw(floats_in(0.05, 2.0, (0.5, 1.0)), label="d_min")
    hi = draw(floats_in(lo, 8.0, (lo, 2.0)), label="d_max")
    return k, beta, mask, lo, hi


@given(box_problems())
def test_random_problems_match_scipy(case):
    k, beta, mask, lo, hi = case
    res = comparator_gap_diag(k, beta, d_min=lo, d_max=hi, mask=mask)
    check_against_scipy(res, k, beta, mask, lo, hi)


@given(box_problems(), st.data())
def test_nothing_in_the_box_is_better_and_the_quadratic_form_is_eps(case, data):
    """At random points of the box (faces included), ε_T written out here is never below the solver's
    value, and the package's stream formula, its normal equations and osdn_diag.math's closed form all
    give that ε_T."""
    k, beta, mask, lo, hi = case
    P, T, K = k.shape
    res = comparator_gap_diag(k, beta, d_min=lo, d_max=hi, mask=mask)
    G, c, c0, T_eff = normal_equations(k, beta, mask)
    for _ in range(3):
        u = torch.rand(P, K, generator=rng(data.draw(seeds), salt=8), dtype=F64)
        corner = torch.rand(P, K, generator=rng(data.draw(seeds), salt=9)) < 0.3
        face = torch.where(u < 0.5, torch.full_like(u, lo), torch.full_like(u, hi))
        d = torch.where(corner, face, (lo + (hi - lo) * u).clamp(lo, hi))
        eps = torch.tensor([eps_written_out(d[i], k[i], beta[i], None if mask is None else mask[i])
                            for i in range(P)], dtype=F64)
        torch.testing.assert_close(comparator_gap_masked(d, k, beta, mask), eps, rtol=1e-12, atol=1e-14)
        assert (eps >= res.value - 1e-12 * (1 + eps.abs())).all(), (eps, res.value)
        quad = 0.5 * (d[:, None, :] @ G @ d[..., None])[:, 0, 0] - (c * d).sum(-1) + c0
        torch.testing.assert_close(quad, eps, rtol=1e-10, atol=1e-12)
        for i in range(P):  # the closed form of osdn_diag.math over the valid tokens of each problem
            m = slice(None) if mask is None else mask[i]
            if int(T_eff[i]) == 0:
                assert eps[i] == 0
                continue
            closed = comparator_gap(d[i], k[i, m], beta[i, m])
            torch.testing.assert_close(closed, eps[i], rtol=1e-12, atol=1e-14)


@given(box_problems(), st.data())
def test_gap_and_kkt_residual_at_any_point(case, data):
    """At an arbitrary point of the box (no iteration), the gap equals max over the box's vertices of
    ∇εᵀ(d − y), bounds ε(d) − min from above, and the residual is ‖d − Π(d − ∇ε)‖∞."""
    k, beta, mask, lo, hi = case
    P, T, K = k.shape
    G, c, c0, _ = normal_equations(k, beta, mask)
    d0 = lo + (hi - lo) * torch.rand(P, K, generator=rng(data.draw(seeds), salt=10), dtype=F64)
    at = solve_box_lsq(G, c, c0, d_min=lo, d_max=hi, d_init=d0, max_iter=0)
    assert at.iterations == 0 and torch.equal(at.d, d0)
    grad = (G @ d0[..., None])[..., 0] - c
    if K <= 6:
        verts = torch.tensor(list(itertools.product([lo, hi], repeat=K)), dtype=F64)  # [2^K, K]
        brute = ((d0[:, None, :] - verts[None]) * grad[:, None, :]).sum(-1).amax(1)
        torch.testing.assert_close(at.gap, brute, rtol=1e-12, atol=1e-15)
    kkt = (d0 - (d0 - grad).clamp(lo, hi)).abs().amax(-1)
    torch.testing.assert_close(at.kkt_residual, kkt, rtol=0, atol=0)
    ref = scipy_value(k, beta, mask, lo, hi)
    assert (at.gap >= at.value - ref - 1e-12 * (1 + ref.abs())).all(), (at.gap, at.value - ref)


# ---------------------------------------------------------------------------------- engineering, inputs


def test_deterministic_and_independent_of_blocking():
    k, beta, mask = problem(4, P=5, T=50, K=7, p_invalid=0.2)
    a = comparator_gap_diag(k, beta, mask=mask)
    b = comparator_gap_diag(k, beta, mask=mask)
    assert torch.equal(a.d, b.d) and torch.equal(a.value, b.value) and torch.equal(a.gap, b.gap)
    c = comparator_gap_diag(k, beta, mask=mask, block_elems=7 * 3)  # one problem, 3 tokens per block
    torch.testing.assert_close(c.value, a.value, rtol=1e-12, atol=1e-15)
    G1 = normal_equations(k, beta, mask)[0]
    G2 = normal_equations(k, beta, mask, block_elems=7 * 3)[0]
    torch.testing.assert_close(G1, G2, rtol=1e-12, atol=1e-15)


def test_fp32_inputs_are_accumulated_in_fp64():
    k, beta, _ = problem(5)
    a = comparator_gap_diag(k, beta)
    b = comparator_gap_diag(k.float(), beta.float())
    assert b.value.dtype == F64 and b.d.dtype == F64
    torch.testing.assert_close(b.value, a.value, rtol=1e-5, atol=1e-7)


def test_d_init_is_projected_and_a_solution_stays_put():
    k, beta, _ = problem(6)
    G, c, c0, _ = normal_equations(k, beta)
    sol = solve_box_lsq(G, c, c0, d_min=0.5, d_max=2.0)
    again = solve_box_lsq(G, c, c0, d_min=0.5, d_max=2.0, d_init=sol.d)
    assert again.iterations == 0 and torch.equal(again.d, sol.d)
    far = solve_box_lsq(G, c, c0, d_min=0.5, d_max=2.0, d_init=torch.full_like(sol.d, 100.0), max_iter=0)
    assert (far.d == 2.0).all()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(k=torch.ones(2, 3)), "k"),
        (dict(beta=torch.ones(2, 4)), "beta"),
        (dict(beta=torch.ones(2, 3, 1)), "beta"),
        (dict(mask=torch.ones(2, 3)), "mask"),
        (dict(mask=torch.ones(2, 4, dtype=torch.bool)), "mask"),
        (dict(d_min=0.0), "d_min"),
        (dict(d_min=-1.0), "d_min"),
        (dict(d_max=0.4), "d_max"),
        (dict(d_max=float("inf")), "d_max"),
        (dict(d_min=float("nan")), "d_min"),
        (dict(k=torch.full((2, 3, 4), float("nan"))), "k"),
        (dict(beta=torch.full((2, 3), float("inf"))), "beta"),
        (dict(k=torch.ones(2, 3, 4, dtype=torch.int64)), "k"),
    ],
)
def test_bad_input_names_the_argument(kwargs, name):
    args = dict(k=torch.rand(2, 3, 4, dtype=F64), beta=torch.rand(2, 3, dtype=F64), d_min=0.5, d_max=2.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"'{name}'"):
        comparator_gap_diag(args.pop("k"), args.pop("beta"), **args)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(G=torch.ones(2, 3, 4, dtype=F64)), "G"),
        (dict(c=torch.ones(2, 4, dtype=F64)), "c"),
        (dict(c0=torch.ones(3, dtype=F64)), "c0"),
        (dict(d_init=torch.ones(2, 2, dtype=F64)), "d_init"),
        (dict(G=torch.full((2, 3, 3), float("nan"), dtype=F64)), "G"),
    ],
)
def test_bad_solver_input_names_the_argument(kwargs, name):
    args = dict(G=torch.eye(3, dtype=F64).expand(2, 3, 3), c=torch.ones(2, 3, dtype=F64))
    args["c0"] = torch.ones(2, dtype=F64)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"'{name}'"):
        solve_box_lsq(args.pop("G"), args.pop("c"), args.pop("c0"), d_min=0.5, d_max=2.0, **args)


def test_nearly_singular_face_with_a_bound_in_its_flat():
    """Regression (found by hypothesis): a token with β = 1e-6 makes G nearly singular (eigenvalues 0,
    7e-14, 6e-3, 0.47); the minimum-norm Newton step on the face of the solution's neighbours pushes a
    coordinate that must stay on its bound out of the box, and projected steps alone crawl. The
    active-set inner loop (fix the blocking coordinate, solve again) finishes in a few iterations."""
    k = torch.tensor(
        [[-1.0, 0, 0, 0], [1, 0, 0, 0], [-0.7817, -0.3642, -0.2967, -0.4103], [1, 0, 0, 0], [-1, 0, 0, 0],
         [0.0812, -0.0484, -0.1805, -0.9790]],
        dtype=F64,
    )
    k = unit(k)[None]
    beta = torch.tensor([[1 - 1e-6, 0.80210, 0.83957, 0.88556, 0.39282, 1e-6]], dtype=F64)
    res = comparator_gap_diag(k, beta)
    assert res.iterations <= 5
    check_against_scipy(res, k, beta, None, 0.5, 2.0)


def test_warm_start_next_to_the_solution_is_certified():
    """A warm start 1e-8 away from an interior solution: the value there is the minimum to within
    fp64 rounding (½δᵀGδ ≈ 1e-17), but the Frank–Wolfe gap is ~1e-9, far above the tolerance. Only
    the gap can tell the solver's candidates apart (the module's selection rule: least gap among
    values within the rounding floor); the solver must still step to the solution and certify it.

    Reference: the unconstrained least-squares solution (numpy), checked to lie inside the box, scipy
    (:func:`check_against_scipy`), and ε_T and its gradient written out here."""
    g = torch.Generator().manual_seed(11)
    P, T, K, lo, hi = 8, 200, 5, 0.5, 2.0
    k = unit(torch.randn(P, T, K, generator=g, dtype=F64))
    d_true = 0.8 + 0.4 * torch.rand(P, K, generator=g, dtype=F64)
    beta = (1 + 0.05 * torch.randn(P, T, generator=g, dtype=F64)) / ((k * k) @ d_true[..., None])[..., 0]
    A = (beta[..., None] * k**2).numpy()  # [P, T, K]
    x = np.stack([np.linalg.lstsq(A[i], np.ones(T), rcond=None)[0] for i in range(P)])
    assert ((x > lo) & (x < hi)).all()
    d0 = torch.from_numpy(x) + 1e-8 * torch.randn(P, K, generator=g, dtype=F64)

    # Why this case: the value cannot show progress, the gap can.
    for i in range(P):
        drop = eps_written_out(d0[i], k[i], beta[i]) - eps_written_out(x[i], k[i], beta[i])
        assert drop < 1e-15  # below the solver's rounding floor, 32 ulp of the value's terms (~1)
        di = d0[i].numpy()
        grad = -(A[i] * (1 - A[i] @ di)[:, None]).mean(0)
        gap0 = (np.clip(grad, 0, None) * (di - lo) + np.clip(-grad, 0, None) * (hi - di)).sum()
        assert gap0 > 10 * REL  # the tolerance the solver must reach: gap ≤ REL (1 + value)

    G, c, c0, _ = normal_equations(k, beta)
    res = solve_box_lsq(G, c, c0, d_min=lo, d_max=hi, d_init=d0)
    assert res.converged.all(), res.gap
    assert (res.gap <= REL * (1 + res.value.abs())).all(), res.gap
    assert res.iterations <= 2, res.iterations
    torch.testing.assert_close(res.d, torch.from_numpy(x), rtol=0, atol=1e-10)
    check_against_scipy(res, k, beta, None, lo, hi)
