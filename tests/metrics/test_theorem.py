"""Theorem D.7 on replayed streams: the real phase-1 iterates (``osdn_phase1``), ratios measured by the
``osdn`` reference recurrence, the bound over valid tokens (``u_t ≠ 0``) only.

What is tested, precisely:

* with unit keys and the hypotheses holding, ``slack ≥ 0`` up to rounding (the bound is AM–GM) and
  ``log_bound = T_eff · log(mean_valid (1 − a_t)²)``, which is ``T_eff · log(mean_valid q_t)`` with the
  measured ratios wherever the residual is macroscopic;
* tokens with a zero residual are excluded: on a stream where they would break the bound, the bound over
  the valid tokens holds and ``n_valid`` counts only the others;
* the hypothesis flags flip for non-unit keys, a gated layer, β = 1, ``d`` outside the box, no valid token;
* the regret at the minimiser ``d*`` of ε_T:
  ``R_T(d*) − R_T(d) = Σ_t [(1 − a_t(d))² − (1 − a_t(d*))²] / (2n_t)``.
  With unit keys (``n_t = 1``) this is ``T_eff (ε_T(d) − ε_T(d*)) ≥ 0``, so ``R_T(d*) ≥ R_T(d)`` for every
  ``d`` in the box. With non-unit keys the ``1/n_t`` weights differ from ε_T's uniform ones and
  ``R_T(d*) < R_T(d)`` is possible: a two-token example shows it.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "math"))  # shared strategies
from osdn_strategies import (  # noqa: E402
    UNIT_KINDS,
    betas,
    dims,
    floats_in,
    keys,
    preconditioners,
    rng,
    seeds,
    states,
    values,
)
from torch.testing import assert_close  # noqa: E402

from osdn_diag.math import comparator_gap, osdn, osdn_phase1, regret, residual_ratio, write_gain  # noqa: E402
from osdn_diag.metrics.comparator import comparator_gap_diag  # noqa: E402
from osdn_diag.metrics.theorem import theorem_d7  # noqa: E402

# The documented columns of comparator.parquet (README, the run directory's table), in theorem_d7's
# order; the hypothesis checks between n_valid and hypotheses_hold are the five named here.
COLUMNS = (
    "eps_diag", "kkt_residual", "gap", "eps_at_ones", "eps_at_final_d", "regret", "log_prod_q", "log_bound",
    "slack", "n_valid", "max_unit_dev", "beta_min", "beta_max", "d_in_box", "share_newton_infeasible",
    "eps_free", "newton_feasible", "newton_feasible_box",
    "key_norm_tol", "unit_keys", "beta_in_open_unit_interval", "no_decay", "hypotheses_hold",
)

F64 = torch.float64
D_MIN, D_MAX = 0.5, 2.0
# Replayed ratios are trusted where f_t(S_{t−1}) exceeds this (unit keys keep the state O(1)); below it a
# "residual" may be rounding noise. This is the replay's notion of a valid token in these tests.
LOSS_FLOOR = 1e-12


def to_problems(x):
    """``[B, T, H, ...]`` → ``[B·H, T, ...]`` (one problem per sequence and head)."""
    B, T, H = x.shape[:3]
    return x.transpose(1, 2).reshape(B * H, T, *x.shape[3:])


@st.composite
def replayed_streams(draw):
    """Unit keys, β ∈ (0, 1), phase-1 trajectory in the box, values with some exactly-zero tokens and an
    initial state that may be 0 (so some residuals are exactly 0)."""
    D = draw(dims(T=(1, 16)))
    B, T, H, K, V = D.B, D.T, D.H, D.K, D.V
    k = draw(keys((B, T, H, K), kinds=UNIT_KINDS))
    beta = draw(betas((B, T, H)))
    eta = draw(floats_in(1e-3, 1.0, (1e-3, 1.0)), label="eta")
    d0 = draw(st.one_of(st.none(), preconditioners((H, K), D_MIN, D_MAX)), label="d0")
    ph1 = osdn_phase1(k, beta, d0=d0, eta=eta, d_min=D_MIN, d_max=D_MAX, beta_aware=draw(st.booleans()))
    v = draw(values((B, T, H, V), zero_tokens=True))
    S0 = draw(states((B, H, V, K)))
    rec = osdn(k, k, v, beta, ph1.d, initial_state=S0)
    q = residual_ratio(rec.loss_after, rec.loss_before)
    valid = rec.loss_before > LOSS_FLOOR
    a = write_gain(k, beta, ph1.d)
    return {n: to_problems(x) for n, x in dict(k=k, beta=beta, d=ph1.d, q=q, valid=valid, a=a).items()}


@given(replayed_streams())
def test_slack_is_nonnegative_and_the_bound_is_am_gm(s):
    out = theorem_d7(s["k"], s["beta"], s["d"], s["q"], s["valid"])
    assert list(out) == list(COLUMNS)
    has = out["n_valid"] > 0
    assert torch.equal(out["hypotheses_hold"], has)
    assert torch.equal(out["n_valid"], s["valid"].sum(1))
    T_eff = out["n_valid"].clamp_min(1).to(F64)
    m = s["valid"]

    # AM–GM identity: 2ε_T(d*) + 2R_T(d*)/T_eff is the mean of (1 − a_t)² over the valid tokens ...
    mean_sq = torch.where(m, (1 - s["a"]) ** 2, 0.0).sum(1) / T_eff
    base = torch.exp(out["log_bound"] / T_eff)
    assert_close(base[has], mean_sq[has], rtol=1e-9, atol=1e-12)
    # ... and that is the mean of the measured ratios (Lemma 4.1).
    mean_q = torch.where(m, s["q"], 0.0).sum(1) / T_eff
    assert_close(base[has], mean_q[has], rtol=1e-8, atol=1e-10)

    # Slack ≥ 0. Where the mean ratio is ~0 (a_t ≈ 1 everywhere) log space magnifies rounding without
    # bound; judge those problems in linear space: geometric mean ≤ arithmetic mean + rounding.
    ok = out["slack"] >= -1e-9
    geo = torch.exp(out["log_prod_q"] / T_eff)
    linear = (mean_sq < 1e-6) & (geo <= mean_sq + 1e-12)
    assert (ok | linear | ~has).all(), (out["slack"], mean_sq)
    assert (out["log_prod_q"][~has] == 0).all() and (out["slack"][~has] == 0).all()

    # Certificates and the other columns.
    # The solver certifies the gap (≤ 1e-10·(1 + ε)); stationarity follows from it, kkt² ≤ gap, and no
    # tighter: on a nearly flat direction (β ≈ 1e-6 on one key, T < K) a certified-optimal value sits
    # beside a gradient of 1e-7 (seed 1411576556 found kkt 1.8e-7 at gap 7.6e-11).
    assert (out["gap"] <= 1e-9).all()
    assert (out["kkt_residual"] ** 2 <= out["gap"] * (1 + 1e-9) + 1e-300).all(), (out["kkt_residual"], out["gap"])
    assert (out["eps_diag"] <= out["eps_at_ones"] + 1e-12).all()
    assert (out["eps_diag"] <= out["eps_at_final_d"] + 1e-12).all()
    for i in torch.nonzero(has)[:, 0].tolist():
        kv, bv, dv = s["k"][i][m[i]], s["beta"][i][m[i]], s["d"][i][m[i]]
        at_ones = comparator_gap(torch.ones_like(kv[0]), kv, bv)
        assert_close(out["eps_at_ones"][i], at_ones, rtol=1e-12, atol=1e-15)
        assert_close(out["eps_at_final_d"][i], comparator_gap(s["d"][i, -1], kv, bv), rtol=1e-12, atol=1e-15)
        d_star = comparator_gap_diag(s["k"][i : i + 1], s["beta"][i : i + 1], mask=m[i : i + 1]).d[0]
        assert_close(out["regret"][i], regret(dv, d_star, kv, bv), rtol=1e-10, atol=1e-12)
        share = (bv < 1 / D_MAX).double().mean()
        assert_close(out["share_newton_infeasible"][i], share)


@given(replayed_streams(), st.data())
def test_regret_is_largest_at_the_minimiser_of_eps_with_unit_keys(s, data):
    """R_T(d*) − R_T(d) = T_eff (ε_T(d) − ε_T(d*)) ≥ 0 for unit keys (n_t = 1 up to rounding)."""
    out = theorem_d7(s["k"], s["beta"], s["d"], s["q"], s["valid"])
    P, T, K = s["k"].shape
    m = s["valid"]
    u = torch.rand(P, K, generator=rng(data.draw(seeds), salt=11), dtype=F64)
    d = D_MIN + (D_MAX - D_MIN) * u
    for i in torch.nonzero(out["n_valid"] > 0)[:, 0].tolist():
        kv, bv, dv = s["k"][i][m[i]], s["beta"][i][m[i]], s["d"][i][m[i]]
        R_d = regret(dv, d[i], kv, bv)
        assert out["regret"][i] >= R_d - 1e-9
        lhs = out["regret"][i] - R_d
        rhs = kv.shape[0] * (comparator_gap(d[i], kv, bv) - out["eps_diag"][i])
        assert_close(lhs, rhs, rtol=1e-8, atol=1e-10)


def test_regret_at_the_minimiser_can_be_smaller_with_non_unit_keys():
    """K = 1, two tokens with ‖k‖² = 1 and 4, β = 1/2. ε_T ∝ (1 − d/2)² + (1 − 2d)² is least at
    d* = 10/17; Σ h_t weighs the second token by 1/4 and is least at d = 4/5, so R_T(d*) < R_T(4/5)."""
    k = torch.tensor([[[1.0], [2.0]]], dtype=F64)
    beta = torch.full((1, 2), 0.5, dtype=F64)
    traj = torch.ones(1, 2, 1, dtype=F64)
    out = theorem_d7(k, beta, traj, torch.ones(1, 2, dtype=F64), torch.ones(1, 2, dtype=torch.bool))
    d_star = torch.tensor([10 / 17], dtype=F64)
    assert out["eps_diag"].item() == pytest.approx(comparator_gap(d_star, k[0], beta[0]).item(), rel=1e-12)
    r_other = regret(traj[0], torch.tensor([0.8], dtype=F64), k[0], beta[0])
    assert out["regret"].item() < r_other.item() - 1e-3
    assert not out["hypotheses_hold"].item() and out["max_unit_dev"].item() == pytest.approx(3.0)


# ----------------------------------------------------------------------------------- zero residuals


def zero_residual_stream():
    """K = V = 1, k = 1, β = 1/4, d_t = 2 (a_t = 1/2), S_0 = 0, v = (0, 0, 1, 1): the first two residuals
    are exactly 0 (q = 1 by convention), the last two give q = (1 − 1/2)² = 1/4."""
    T = 4
    k = torch.ones(1, T, 1, 1, dtype=F64)
    beta = torch.full((1, T, 1), 0.25, dtype=F64)
    d = torch.full((1, T, 1, 1), 2.0, dtype=F64)
    v = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=F64).reshape(1, T, 1, 1)
    rec = osdn(k, k, v, beta, d)
    q = residual_ratio(rec.loss_after, rec.loss_before)
    return to_problems(k), to_problems(beta), to_problems(d), to_problems(q), to_problems(rec.loss_before)


def test_zero_residual_tokens_are_excluded():
    k, beta, d, q, before = zero_residual_stream()
    assert before[0].tolist() == [0.0, 0.0, 0.5, pytest.approx(0.125)]
    assert_close(q[0], torch.tensor([1.0, 1.0, 0.25, 0.25], dtype=F64))
    # The paper's convention (every token, q = 1 at u = 0) breaks the bound: 4 log(1/4) < 2 log(1/4).
    everything = theorem_d7(k, beta, d, q, torch.ones_like(before, dtype=torch.bool))
    assert everything["hypotheses_hold"].item() and everything["slack"].item() < -1.0
    # Over the valid tokens it holds (with equality: the two ratios are equal).
    out = theorem_d7(k, beta, d, q, before > 0)
    assert out["n_valid"].item() == 2 and out["hypotheses_hold"].item()
    assert out["slack"].item() == pytest.approx(0.0, abs=1e-12)
    assert out["log_bound"].item() == pytest.approx(2 * math.log(0.25), rel=1e-12)
    assert out["log_prod_q"].item() == pytest.approx(2 * math.log(0.25), rel=1e-12)


def test_exact_zero_ratio_gives_minus_infinity_and_zero_slack():
    """β = 1/2, d = 2: a_t = 1, q_t = 0 at every token. Π q = 0 = (mean q)^T: slack 0, not NaN."""
    k = torch.ones(1, 3, 1, dtype=F64)
    beta = torch.full((1, 3), 0.5, dtype=F64)
    d = torch.full((1, 3, 1), 2.0, dtype=F64)
    out = theorem_d7(k, beta, d, torch.zeros(1, 3, dtype=F64), torch.ones(1, 3, dtype=torch.bool))
    assert torch.isneginf(out["log_prod_q"]).all() and torch.isneginf(out["log_bound"]).all()
    assert out["slack"].item() == 0.0 and out["eps_diag"].item() == 0.0


def test_a_zero_ratio_under_a_positive_bound_has_infinite_slack():
    """slack = log_bound − log_prod_q, and 0 only where both are −inf: a product Π q_t = 0 under a
    positive bound holds with room to spare (+inf), not with equality."""
    k = torch.ones(1, 2, 1, dtype=F64)
    beta = torch.full((1, 2), 0.25, dtype=F64)
    d = torch.ones(1, 2, 1, dtype=F64)
    q = torch.tensor([[0.5, 0.0]], dtype=F64)
    out = theorem_d7(k, beta, d, q, torch.ones(1, 2, dtype=torch.bool))
    assert torch.isneginf(out["log_prod_q"]).all() and torch.isfinite(out["log_bound"]).all()
    assert out["slack"].item() == math.inf


# ---------------------------------------------------------------------------------- hypothesis flags


def _base_case():
    g = torch.Generator().manual_seed(0)
    P, T, K = 3, 12, 4
    k = torch.nn.functional.normalize(torch.randn(P, T, K, generator=g, dtype=F64), dim=-1)
    beta = 0.1 + 0.8 * torch.rand(P, T, generator=g, dtype=F64)
    d = D_MIN + (D_MAX - D_MIN) * torch.rand(P, T, K, generator=g, dtype=F64)
    q = ((1 - write_gain(k, beta, d)) ** 2).clone()
    valid = torch.ones(P, T, dtype=torch.bool)
    valid[:, 0] = False
    return dict(k=k, beta=beta, d_traj=d, q=q, valid=valid)


def _run(case, **kw):
    c = dict(case)
    return theorem_d7(c.pop("k"), c.pop("beta"), c.pop("d_traj"), c.pop("q"), c.pop("valid"), **kw)


def test_flags_hold_on_the_base_case():
    out = _run(_base_case())
    assert out["hypotheses_hold"].all() and out["d_in_box"].all()
    assert (out["n_valid"] == 11).all() and (out["slack"] >= -1e-12).all()
    assert (out["max_unit_dev"] < 1e-12).all()


def test_non_unit_keys_flip_the_flag():
    case = _base_case()
    case["k"] = case["k"].clone()
    case["k"][1, 5] *= 1.1  # ‖k‖² = 1.21
    out = _run(case)
    assert out["hypotheses_hold"].tolist() == [True, False, True]
    assert out["max_unit_dev"][1].item() == pytest.approx(0.21)
    assert _run(case, unit_tol=0.25)["hypotheses_hold"].all()
    case["k"][2, 0] *= 1.1  # on an invalid token: ignored
    assert _run(case)["hypotheses_hold"][2]


def test_gated_flips_the_flag():
    assert not _run(_base_case(), gated=True)["hypotheses_hold"].any()
    mixed = _run(_base_case(), gated=torch.tensor([False, True, False]))
    assert mixed["hypotheses_hold"].tolist() == [True, False, True]


@pytest.mark.parametrize("value", [1.0, 0.0, 1.5])
def test_beta_outside_the_open_unit_interval_flips_the_flag(value):
    case = _base_case()
    case["beta"] = case["beta"].clone()
    case["beta"][0, 3] = value
    case["beta"][2, 0] = value  # invalid token: ignored
    out = _run(case)
    assert out["hypotheses_hold"].tolist() == [False, True, True]
    assert (out["beta_max"][0] if value >= 1 else out["beta_min"][0]).item() == value


@pytest.mark.parametrize("value", [0.49, 2.01])
def test_d_outside_the_box_flips_the_flag(value):
    case = _base_case()
    case["d_traj"] = case["d_traj"].clone()
    case["d_traj"][1, 7, 2] = value
    case["d_traj"][2, 0, 2] = value  # invalid token: ignored
    out = _run(case)
    assert out["d_in_box"].tolist() == [True, False, True]
    assert out["hypotheses_hold"].tolist() == [True, False, True]


def test_no_valid_token():
    case = _base_case()
    case["valid"] = case["valid"].clone()
    case["valid"][1] = False
    case["q"] = case["q"].clone()
    case["q"][1] = float("nan")  # never read
    out = _run(case)
    assert out["hypotheses_hold"].tolist() == [True, False, True]
    assert out["n_valid"][1] == 0
    zeros = ("eps_diag", "eps_at_ones", "eps_at_final_d", "regret", "log_prod_q", "log_bound", "slack", "gap")
    for name in zeros:
        assert out[name][1].item() == 0.0, name
    for name in ("max_unit_dev", "beta_min", "beta_max", "share_newton_infeasible"):
        assert math.isnan(out[name][1].item()), name


def test_plain_deltanet_trajectory_and_chunking():
    case = _base_case()
    ones = dict(case, d_traj=torch.ones_like(case["d_traj"]))
    a, b = _run(ones), _run(dict(case, d_traj=None))
    c = _run(ones, block_elems=12 * 4)  # one problem per chunk
    for name in COLUMNS:
        assert torch.equal(a[name], b[name]), name
        assert_close(c[name], a[name], rtol=1e-12, atol=1e-15, equal_nan=True)


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(q=-1.0), "q"),
        (dict(q=float("nan")), "q"),
        (dict(k=float("inf")), "k"),
        (dict(beta=float("nan")), "beta"),
        (dict(d_traj=float("nan")), "d_traj"),
    ],
)
def test_bad_values_at_valid_tokens_name_the_argument(change, name):
    case = _base_case()
    (arg, value), = change.items()
    case[arg] = case[arg].clone()
    case[arg][0, 0] = value  # invalid token: fine
    _run(case)
    case[arg][0, 1] = value
    with pytest.raises(ValueError, match=f"'{name}'"):
        _run(case)


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(k=torch.ones(3, 12)), "k"),
        (dict(beta=torch.ones(3, 11, dtype=F64)), "beta"),
        (dict(q=torch.ones(3, 12, 1, dtype=F64)), "q"),
        (dict(d_traj=torch.ones(3, 12, 5, dtype=F64)), "d_traj"),
        (dict(valid=torch.ones(3, 12)), "valid"),
        (dict(valid=torch.ones(3, 11, dtype=torch.bool)), "valid"),
    ],
)
def test_bad_shapes_name_the_argument(change, name):
    case = dict(_base_case(), **change)
    with pytest.raises(ValueError, match=f"'{name}'"):
        _run(case)


def test_bad_options_name_the_argument():
    with pytest.raises(ValueError, match="'d_min'"):
        _run(_base_case(), d_min=0.0)
    with pytest.raises(ValueError, match="'gated'"):
        _run(_base_case(), gated=torch.tensor([1.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="'unit_tol'"):
        _run(_base_case(), unit_tol=-1.0)


# ------------------------------------------------------------------ the gated Newton system per stream

NEWTON_TOL = 1e-9  # docs/metrics.md


def _lstsq_gap(k, beta, valid):
    """min over d ∈ R^K of ½·mean (1 − β_t⟨d, k_t⊙k_t⟩)² over the valid tokens, by numpy's SVD least
    squares on the T_eff × K system itself (not its normal equations)."""
    A = (beta[valid, None] * k[valid] ** 2).numpy()
    d, *_ = np.linalg.lstsq(A, np.ones(A.shape[0]), rcond=None)
    return 0.5 * float(np.mean((1.0 - A @ d) ** 2))


def _unit_simplex_stream(g, T, K):
    k = torch.nn.functional.normalize(torch.randn(T, K, generator=g, dtype=F64), dim=-1)
    beta = 0.6 + 0.39 * torch.rand(T, generator=g, dtype=F64)
    return k, beta


def test_newton_system_is_square_solvable_and_overdetermined_not():
    """K = 16, unit keys, β ∈ [0.6, 0.99]: T = 16 equations are solvable in R^K, T = 32 are not — the
    issue's figures (ε_free 0 and about 3e-3), against numpy's least squares."""
    g = torch.Generator().manual_seed(5)
    K = 16
    for T, solvable in ((8, True), (16, True), (32, False), (64, False)):
        k, beta = _unit_simplex_stream(g, T, K)
        valid = torch.ones(T, dtype=torch.bool)
        out = theorem_d7(k[None], beta[None], None, torch.full((1, T), 0.5, dtype=F64), valid[None])
        ref = _lstsq_gap(k, beta, valid)
        assert out["newton_feasible"].item() is solvable, (T, out["eps_free"].item(), ref)
        if solvable:
            assert out["eps_free"].item() <= 1e-20 and ref <= 1e-20
        else:
            assert out["eps_free"].item() == pytest.approx(ref, rel=1e-9)
            assert out["eps_free"].item() > 1e-4
        assert out["eps_free"].item() <= out["eps_diag"].item() + 1e-15


def test_newton_system_in_the_box_and_outside_it():
    """β_t = 1/⟨d⋆, s_t⟩ makes every one of T > K equations hold at d⋆: feasible in the box when d⋆ is
    inside it, only in R^K when d⋆ has a coordinate at 3 > d_max."""
    g = torch.Generator().manual_seed(6)
    T, K = 24, 4
    k = torch.nn.functional.normalize(torch.randn(T, K, generator=g, dtype=F64), dim=-1)
    s = k * k
    inside = torch.tensor([0.7, 1.2, 1.9, 1.0], dtype=F64)
    outside = torch.tensor([0.7, 1.2, 3.0, 1.0], dtype=F64)
    ks = torch.stack([k, k])
    beta = torch.stack([1.0 / (s @ inside), 1.0 / (s @ outside)])
    valid = torch.ones(2, T, dtype=torch.bool)
    out = theorem_d7(ks, beta, None, torch.full((2, T), 0.5, dtype=F64), valid)
    assert out["newton_feasible"].tolist() == [True, True]
    assert out["newton_feasible_box"].tolist() == [True, False]
    assert (out["eps_free"] <= 1e-20).all()
    assert out["eps_diag"][1].item() > 1e-6
    # A rank-one stream (one key repeated) with one consistent gate is solvable whatever T is.
    rep = k[:1].expand(T, K).clone()
    out = theorem_d7(rep[None], (1.0 / (s[:1] @ inside)).expand(T)[None], None,
                     torch.full((1, T), 0.5, dtype=F64), valid[:1])
    assert out["newton_feasible"].item() and out["eps_free"].item() <= 1e-20
    # One-hot keys on two of four coordinates: the normal equations are exactly singular; with one gate
    # per coordinate the system is solvable (d = 1/β there), in the box too.
    onehot = torch.zeros(T, K, dtype=F64)
    onehot[torch.arange(T), torch.arange(T) % 2] = 1.0
    out = theorem_d7(onehot[None], torch.full((1, T), 0.8, dtype=F64), None,
                     torch.full((1, T), 0.5, dtype=F64), valid[:1])
    assert out["newton_feasible"].item() and out["newton_feasible_box"].item()
    assert out["eps_free"].item() <= 1e-20


def test_newton_flags_follow_the_valid_tokens():
    """Only valid tokens are equations: masking all but K of them makes the system square; no valid
    token leaves the flags false and ε_free NaN."""
    g = torch.Generator().manual_seed(7)
    T, K = 40, 8
    k, beta = _unit_simplex_stream(g, T, K)
    few = torch.zeros(T, dtype=torch.bool)
    few[::5] = True  # 8 tokens
    none = torch.zeros(T, dtype=torch.bool)
    out = theorem_d7(torch.stack([k, k, k]), torch.stack([beta, beta, beta]), None,
                     torch.full((3, T), 0.5, dtype=F64), torch.stack([torch.ones(T, dtype=torch.bool), few, none]))
    assert out["newton_feasible"].tolist() == [False, True, False]
    assert out["eps_free"][0].item() == pytest.approx(_lstsq_gap(k, beta, torch.ones(T, dtype=torch.bool)), rel=1e-9)
    assert math.isnan(out["eps_free"][2].item()) and not out["newton_feasible_box"][2].item()


def test_newton_gap_mixes_cholesky_and_eigendecomposition(monkeypatch):
    """One batch of a long varied stream (Cholesky), fewer tokens than keys and one-hot keys (singular:
    the eigendecomposition): each problem's ε_free equals numpy's least squares, and only the singular
    ones take the slow path (on a GPU it costs ~1.6 ms a problem at K = 128)."""
    from osdn_diag.metrics import theorem as th

    g = torch.Generator().manual_seed(8)
    T, K = 48, 8
    long_k, long_b = _unit_simplex_stream(g, T, K)
    short_k, short_b = _unit_simplex_stream(g, T, K)
    onehot = torch.zeros(T, K, dtype=F64)
    onehot[torch.arange(T), torch.arange(T) % 3] = 1.0
    k = torch.stack([long_k, short_k, onehot])
    beta = torch.stack([long_b, short_b, 0.6 + 0.3 * torch.rand(T, generator=g, dtype=F64)])
    valid = torch.ones(3, T, dtype=torch.bool)
    valid[1, 5:] = False  # five equations in eight unknowns
    seen = []
    eig = th._eig_minimiser
    monkeypatch.setattr(th, "_eig_minimiser", lambda G, c: seen.append(G.shape[0]) or eig(G, c))
    out = theorem_d7(k, beta, None, torch.full((3, T), 0.5, dtype=F64), valid)
    assert seen == [2]
    for i in range(3):
        ref = _lstsq_gap(k[i], beta[i], valid[i])
        assert out["eps_free"][i].item() == pytest.approx(ref, rel=1e-9, abs=1e-20), i
    assert out["newton_feasible"].tolist() == [False, True, False]


def test_box_solver_starts_from_the_projected_free_minimiser(monkeypatch):
    """theorem_d7 starts the box solver from Π_box(d_free), the unconstrained minimiser it computes for
    eps_free anyway: the same certified minimum as from the solver's own start d = 1, in fewer
    iterations (each costs a few hundred kernel launches on a GPU); a caller's own d_init is kept."""
    import osdn_diag.metrics.theorem as th
    from osdn_diag.metrics.comparator import normal_equations, solve_box_lsq

    g = torch.Generator().manual_seed(3)
    P, T, K = 24, 512, 32
    k = torch.nn.functional.normalize(torch.randn(P, T, K, generator=g), dim=-1)
    beta = torch.sigmoid(torch.randn(P, T, generator=g))
    valid = torch.rand(P, T, generator=g) > 0.02
    q = torch.rand(P, T, generator=g, dtype=F64)
    seen = []

    def spy(*args, **kw):
        res = solve_box_lsq(*args, **kw)
        seen.append((kw.get("d_init"), res))
        return res

    monkeypatch.setattr(th, "solve_box_lsq", spy)
    cols = theorem_d7(k, beta, None, q, valid, d_min=D_MIN, d_max=D_MAX)
    (d_init, warm), = seen
    G, c, c0, _ = normal_equations(k, beta, valid)
    assert_close(d_init, th._free_minimiser(G, c).clamp(D_MIN, D_MAX), rtol=0, atol=0)
    cold = solve_box_lsq(G, c, c0, d_min=D_MIN, d_max=D_MAX)
    assert bool(warm.converged.all()) and bool(cold.converged.all())
    assert warm.iterations < cold.iterations, (warm.iterations, cold.iterations)
    # Both certified: each value is within its gap of the minimum, hence of the other's value.
    assert bool(((cols["eps_diag"] - cold.value).abs() <= warm.gap + cold.gap + 1e-15).all())
    seen.clear()
    theorem_d7(k, beta, None, q, valid, d_min=D_MIN, d_max=D_MAX, solver_kw={"d_init": torch.ones(P, K)})
    assert bool((seen[0][0] == 1).all())
