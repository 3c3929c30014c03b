"""Lemma D.6 / Proposition A.1 (curvature of the surrogate) and Proposition A.3 (APF is affine).

Notation: key ``k ∈ R^K`` (real symbols), ``s = k ⊙ k``, ``n = ‖k‖²``, gate ``β``, preconditioner
``d``, surrogate ``h(d) = ((1 − β⟨d, s⟩)² − 1)/(2n)`` (Lemma 4.1), ``λ = β²‖s‖²/n``.

Lemma D.6, for K = 1..4: the Hessian of ``h`` is ``H = β²/n · s sᵀ`` and does not depend on ``d``
(third derivatives vanish, so ``h`` is an exact quadratic). It is an outer product, so rank ≤ 1 and
``xᵀHx = β²(sᵀx)²/n ≥ 0`` (PSD); ``H s = λ s`` and ``tr H = λ``, so ``λ`` is its only nonzero
eigenvalue and its operator norm. These lines do not depend on K.

Proposition A.1 (unit keys, β ≤ 1): ``n² − ‖s‖² = (Σ k_i²)² − Σ k_i⁴ = 2 Σ_{i<j} k_i² k_j² ≥ 0``, so
``λ ≤ β² n``, which is ``β² ≤ 1`` when ``n = 1``. For general keys the bound is ``β²‖k‖²``, not 1.

Proposition A.3: the APF step ``d̄ = r d + η β (1 − β⟨d, s⟩)/n̄ · s`` (``n̄ = max(n, ε)``, a constant
in ``d``) has Jacobian ``r I − η β²/n̄ · s sᵀ`` and offset ``η β/n̄ · s``, with vanishing second
derivatives — it is affine in ``d``; per-channel retention ``diag(r)`` and the 1.3B model's
non-beta-aware form ``ρ d + η (1 − ⟨d, s⟩)/n̄ · s`` likewise. For ``n ≥ ε`` and ``r = 1`` it is exactly
``d − η ∇h(d)``. The coefficients involve only ``k, β, r, η``: no state, value or residual.
"""

from __future__ import annotations

import sympy as sp

from ._claims import Claim, Outcome, conclude
from ._evidence import Derivation, derive, format_sizes, format_values
from ._sym import all_vanish, dot, free_of, holds_on, is_nonnegative, vanishes, vector
from .lemma_4_1 import surrogate_closed_form, surrogate_gradient_closed_form

__all__ = ["CLAIMS", "GRID", "apf_step", "apf_steps", "gate_steps", "hessian_steps", "smoothness_steps"]

#: the key dimensions checked with explicit symbols
GRID = {"K": tuple(range(1, 5))}


def _key(K: int):
    k = vector("k", K, real=True)
    return k, k.multiply_elementwise(k), dot(k, k)


def hessian_steps(K: int) -> dict[str, bool]:
    """Lemma D.6's Hessian statements for one K."""
    k, s, n = _key(K)
    d, x = vector("d", K, real=True), vector("x", K, real=True)
    beta = sp.Symbol("beta", real=True)
    H = sp.hessian(surrogate_closed_form(beta * dot(d, s), n), list(d))
    lam = beta**2 * dot(s, s) / n
    n_pos = sp.Symbol("n", positive=True)  # k ≠ 0
    return {
        "H = β²/n s sᵀ": all_vanish(H, beta**2 / n * s * s.T),
        "H constant in d": free_of(H, d),
        "xᵀHx = β²(sᵀx)²/n": vanishes((x.T * H * x)[0], beta**2 * dot(s, x) ** 2 / n),
        "β²(sᵀx)²/n ≥ 0 for n > 0": is_nonnegative(beta**2 * dot(s, x) ** 2 / n_pos),
        "H s = λ s": all_vanish(H * s, lam * s),
        "tr H = λ": vanishes(H.trace(), lam),
    }


def smoothness_steps(K: int) -> dict[str, bool]:
    """Proposition A.1's bound ``λ ≤ β² ≤ 1`` (unit keys, ``0 < β ≤ 1``) for one K."""
    k, s, n = _key(K)
    beta = sp.Symbol("beta", positive=True)
    cross = 2 * sum(k[i] ** 2 * k[j] ** 2 for i in range(K) for j in range(i + 1, K))
    lam = beta**2 * dot(s, s) / n
    return {
        "n² − ‖s‖² = 2Σ_{i<j} k_i²k_j²": vanishes(n**2 - dot(s, s), cross),
        "2Σ_{i<j} k_i²k_j² ≥ 0": is_nonnegative(cross),
        "β²n − λ = β²(n² − ‖s‖²)/n": vanishes(beta**2 * n - lam, beta**2 * (n**2 - dot(s, s)) / n),
    }


def gate_steps() -> dict[str, bool]:
    """``β² ≤ 1`` for ``0 < β ≤ 1`` (no size involved)."""
    beta, gap = sp.Symbol("beta", positive=True), sp.Symbol("g", nonnegative=True)
    return {
        "1 − β² = g(1 + β) with g = 1 − β": holds_on(1 - beta**2, gap * (1 + beta), {gap: 1 - beta}),
        "g(1 + β) ≥ 0": is_nonnegative(gap * (1 + beta)),
    }


def apf_step(d: sp.Matrix, s: sp.Matrix, n_bar, beta, eta, retention, beta_aware: bool = True) -> sp.Matrix:
    """Unprojected phase-1 step (Eq. 7 / Eq. 12); ``retention`` is a scalar or a K-vector."""
    r = retention if isinstance(retention, sp.Matrix) else retention * sp.ones(len(d), 1)
    b = beta if beta_aware else sp.Integer(1)
    return r.multiply_elementwise(d) + eta * b * (1 - b * dot(d, s)) / n_bar * s


def apf_steps(K: int) -> dict[str, bool]:
    """Proposition A.3 for one K: Jacobian, offset, vanishing second derivatives, three forms."""
    k, s, n = _key(K)
    d = vector("d", K, real=True)
    beta, eta, r, n_bar = sp.symbols("beta eta r n_bar", real=True)
    r_vec = vector("r", K, real=True)
    ss = s * s.T
    # name: (step, expected Jacobian, expected offset)
    forms = {
        "scalar r": (
            apf_step(d, s, n_bar, beta, eta, r),
            r * sp.eye(K) - eta * beta**2 / n_bar * ss,
            eta * beta / n_bar * s,
        ),
        "diag(r)": (
            apf_step(d, s, n_bar, beta, eta, r_vec),
            sp.diag(*r_vec) - eta * beta**2 / n_bar * ss,
            eta * beta / n_bar * s,
        ),
        "non-beta-aware": (
            apf_step(d, s, n_bar, beta, eta, r, beta_aware=False),
            r * sp.eye(K) - eta / n_bar * ss,
            eta / n_bar * s,
        ),
    }
    steps = {}
    for name, (step, jac, offset) in forms.items():
        J = step.jacobian(d)
        steps[f"{name}: Jacobian"] = all_vanish(J, jac)
        steps[f"{name}: second derivatives vanish"] = free_of(J, d)
        steps[f"{name}: offset"] = all_vanish(step.subs(dict.fromkeys(d, 0)), offset)
    grad = surrogate_gradient_closed_form(beta, beta * dot(d, s), n, s)
    step = apf_step(d, s, n, beta, eta, sp.Integer(1))
    steps["r = 1, n̄ = n step is d − η∇h"] = all_vanish(step, d - eta * grad)
    return steps


def check_hessian() -> Outcome:
    proof = derive("Hessian of the closed form", hessian_steps, **GRID)
    return conclude(
        "∇²h = β²/n · s sᵀ exactly and independent of d (h is an exact quadratic); as an outer product it "
        "has rank ≤ 1 and xᵀHx = β²(sᵀx)²/n ≥ 0; H s = λ s and tr H = λ, so its operator norm is "
        f"λ = β²‖s‖²/n. Shown for {format_sizes(proof.sizes)}; the argument does not depend on K.",
        [proof],
        numbers={"K_checked": format_values(proof.sizes["K"])},
    )


def check_smoothness() -> Outcome:
    proof = derive("‖s‖² ≤ n²", smoothness_steps, **GRID)
    gate = Derivation("β² ≤ 1", gate_steps())
    return conclude(
        "‖k‖⁴ − Σk_i⁴ = 2Σ_{i<j} k_i²k_j² ≥ 0 gives λ = β²Σk_i⁴/‖k‖² ≤ β²‖k‖², i.e. λ ≤ β² ≤ 1 for unit "
        f"keys and β ∈ (0, 1] ({format_sizes(proof.sizes)}; the sum-of-cross-terms argument holds for all "
        "K). Without unit keys the bound is β²‖k‖², which can exceed 1.",
        [proof, gate],
        numbers={"K_checked": format_values(proof.sizes["K"])},
    )


def check_apf() -> Outcome:
    proof = derive("APF step is affine", apf_steps, **GRID)
    return conclude(
        "The unprojected APF step has constant Jacobian rI − ηβ²/n̄ · s sᵀ (diag(r) − … for per-channel "
        "retention; rI − η/n̄ · s sᵀ for the non-beta-aware 1.3B form), offset ηβ/n̄ · s and zero second "
        "derivatives: it is affine in d with coefficients from (k, β, r, η) only; with r = 1 and n ≥ ε "
        f"it is d − η∇h(d). Shown for {format_sizes(proof.sizes)}.",
        [proof],
        numbers={"K_checked": format_values(proof.sizes["K"])},
    )


CLAIMS = [
    Claim(
        id="lemma-d6-hessian",
        location="App. D.4, Lemma D.6; App. A.3",
        quote="the function h t ( d ) in Equation (18) is convex quadratic in d",
        statement="h is a convex quadratic in d: its Hessian β²/‖k‖² · s sᵀ is constant, rank one, "
        "PSD, with operator norm β²‖s‖²/‖k‖².",
        method=f"sympy, {format_sizes(GRID)}: hessian of the closed form minus β²/n s sᵀ vanishes; third "
        "derivatives vanish; xᵀHx = β²(sᵀx)²/n; H s = λ s and tr H = λ (rank-one PSD).",
        expected="verified",
        check=check_hessian,
    ),
    Claim(
        id="prop-a1-smoothness",
        location="App. A.4, Prop. A.1; Lemma D.6; Sec. 4.2",
        quote="Proposition A.1 (Smoothness of the hypergradient surrogate).",
        statement="With unit keys and β ≤ 1 the surrogate is at most 1-smooth: ‖∇²h‖ = β²Σk_i⁴ ≤ β² ≤ 1.",
        method=f"sympy, {format_sizes(GRID)}: "
        "‖k‖⁴ − Σk_i⁴ equals 2Σ_{i<j}k_i²k_j², nonnegative from real k; "
        "1 − β² = (1 − β)(1 + β) ≥ 0.",
        expected="verified",
        check=check_smoothness,
    ),
    Claim(
        id="prop-a3-apf-affine",
        location="App. A.5, Prop. A.3; Sec. 4.4 Eq. (7); App. B Eq. (12)",
        quote="For fixed k t , β t , and r t , h , the unconstrained APF step is affine in d t",
        statement="For fixed k, β and retention r, the unprojected APF step is affine in d with "
        "Jacobian rI − ηβ²/n̄ s sᵀ and offset ηβ/n̄ s (likewise diag(r)); it involves no state, "
        "value or residual.",
        method=f"sympy, {format_sizes(GRID)}: Jacobian and offset of the step match; its second derivatives "
        "vanish; also for diag(r) and the non-beta-aware form; r = 1 step equals d − η∇h.",
        expected="verified",
        check=check_apf,
    ),
]
