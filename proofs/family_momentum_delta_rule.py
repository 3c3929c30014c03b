"""fla's momentum delta rule (``MomentumDeltaNet``): what Lemma 4.1 becomes for one token.

Notation (state ``S ∈ R^{V×K}``, as the replay): decay ``α``, momentum decay ``μ``, step ``β``, write
scale ``η``; the layer's residual key is ``α k`` and its write key ``η k``, so with the previous
buffer ``M`` (``V×K``) one token does

    r = S(αk) − v,   M' = μ M + r (ηk)ᵀ,   S' = αS − βM'.

With ``e = S̄k − v`` (``S̄ = αS``), ``m = M k`` and ``a = βη‖k‖²`` the token's residual after the write is

    S'k − v = (1 − a) e − βμ m,

so the post-decay ratio is ``q_post = ‖(1 − a)e − βμ m‖² / ‖e‖²``: Lemma 4.1's ``(1 − a)²`` plus a
cross term and a square in the buffer's read-out ``m`` along the token's key. It is closed-form only
given ``m`` (the momentum buffer carries every earlier token's gradient, so ``m`` is not a function
of the token), and reduces to ``(1 − a)²`` when ``m = 0`` (an empty buffer, or ``μ = 0``).

(a) The identity, for K = 1..3 and V = 1..2 with every entry symbolic (``S``, ``M``, ``k``, ``v``,
    scalars), and the reduction at ``M = 0``.
(b) Corollary A.2's conclusion (every write with ``0 < a < 2`` contracts) does not carry over: an
    exact instance with ``a = 1/2`` and a buffer pointing against the residual has ``q_post = 9/4``.
"""

from __future__ import annotations

import sympy as sp

from ._claims import Claim, conclude
from ._evidence import Counterexample, derive, format_sizes
from ._sym import all_vanish, dot, matrix, vanishes, vector

__all__ = ["CLAIMS", "GRID", "one_token_steps"]

GRID = {"K": (1, 2, 3), "V": (1, 2)}


def _one_token(K: int, V: int):
    S, M = matrix("S", V, K, real=True), matrix("M", V, K, real=True)
    k, v = vector("k", K, real=True), vector("v", V, real=True)
    alpha, mu, beta, eta = sp.symbols("alpha mu beta eta", real=True)
    r = S * (alpha * k) - v
    M_new = mu * M + r * (eta * k).T
    S_new = alpha * S - beta * M_new
    e = alpha * S * k - v
    m = M * k
    a = beta * eta * dot(k, k)
    return dict(S=S, M=M, k=k, v=v, alpha=alpha, mu=mu, beta=beta, eta=eta, S_new=S_new, e=e, m=m, a=a)


def one_token_steps(K: int, V: int) -> dict[str, bool]:
    """The residual after one momentum write, and the ratio it gives, for one (K, V)."""
    x = _one_token(K, V)
    after = x["S_new"] * x["k"] - x["v"]
    closed = (1 - x["a"]) * x["e"] - x["beta"] * x["mu"] * x["m"]
    err2 = dot(after, after)
    e2, m2, em = dot(x["e"], x["e"]), dot(x["m"], x["m"]), dot(x["e"], x["m"])
    a, bm = x["a"], x["beta"] * x["mu"]
    empty = {s: 0 for s in x["M"]}
    return {
        "S'k − v = (1 − a)e − βμ Mk": all_vanish(after, closed),
        "‖S'k − v‖² = (1 − a)²‖e‖² − 2(1 − a)βμ⟨e, Mk⟩ + β²μ²‖Mk‖²": vanishes(
            err2, (1 - a) ** 2 * e2 - 2 * (1 - a) * bm * em + bm**2 * m2),
        "M = 0: ‖S'k − v‖² = (1 − a)²‖e‖² (Lemma 4.1)": vanishes(
            err2.subs(empty, simultaneous=True), (1 - a) ** 2 * e2),
    }


def check_one_token():
    proof = derive("one momentum write, every entry symbolic", one_token_steps, **GRID)
    return conclude(
        "S'k − v = (1 − a)(S̄k − v) − βμ M_{t−1}k with a = βη‖k‖², so q_post = ‖(1 − a)e − βμ m‖²/‖e‖² "
        f"({format_sizes(proof.sizes)}, every entry symbolic); with an empty buffer it is (1 − a)², "
        "Lemma 4.1's form with write gain βη‖k‖².",
        [proof],
    )


def check_contraction():
    # K = V = 1, unit key, α = 1, β = 1/2, η = 1 (a = 1/2), S = 0, v = −1 (e = 1), μ = 1/2 and M = −4,
    # so βμ m = −1 and the residual grows from 1 to 3/2.
    half = sp.Rational(1, 2)
    vals = {"alpha": 1, "beta": half, "eta": 1, "mu": half, "S": 0, "M": -4, "k": 1, "v": -1}
    x = _one_token(1, 1)
    subs = {x["alpha"]: 1, x["beta"]: half, x["eta"]: 1, x["mu"]: half, x["S"][0]: 0, x["M"][0]: -4,
            x["k"][0]: 1, x["v"][0]: -1}
    after = (x["S_new"] * x["k"] - x["v"])[0].subs(subs)
    e = x["e"][0].subs(subs)
    q_post = sp.nsimplify(after**2 / e**2)
    a = x["a"].subs(subs)
    ce = Counterexample(
        "a = 1/2, buffer against the residual", lhs=q_post, op="<", rhs=1, instance=vals,
        sizes={"K": (1,), "V": (1,)}, steps={"0 < a < 2": bool(0 < a < 2), "0 < μ < 1": bool(0 < half < 1)},
    )
    return conclude(
        f"With a = βη‖k‖² = {a} ∈ (0, 2) and μ = 1/2 the buffer's read-out βμ M k = −1 pushes the residual "
        f"from {e} to {after}: q_post = {q_post} > 1. A momentum write need not contract.",
        [ce],
        numbers={"q_post": str(q_post)},
    )


CLAIMS = [
    Claim(
        id="momentum-one-token-ratio",
        location="Lemma 4.1, asked of fla 0.6.0's MomentumDeltaNet (fla/ops/momentum_delta_rule)",
        quote="Lemma 4.1 (Closed-form hypergradient). For any d t ∈ ℝ K , β t ∈ ( 0 , 1 ) , and k t ≠ 0",
        statement="For one momentum write with residual key αk and write key ηk, S_tk − v = (1 − a)(S̄k − v) − "
        "βμ M_{t−1}k with a = βη‖k‖²; hence q_post = ‖(1 − a)e − βμ m‖²/‖e‖², = (1 − a)² with an empty buffer.",
        method=f"sympy, {format_sizes(GRID)}: the write expanded entrywise against the closed form; its "
        "squared norm; the substitution M = 0.",
        expected="verified",
        source="package",
        check=check_one_token,
    ),
    Claim(
        id="momentum-writes-contract",
        location="Corollary A.2's conclusion, asked of fla 0.6.0's MomentumDeltaNet",
        quote="Corollary A.2 (Monotone descent under bounded box).",
        statement="Every momentum write with 0 < a = βη‖k‖² < 2 and 0 < μ < 1 contracts the token's "
        "post-decay loss (q_post < 1), as every delta-rule write does.",
        method="an exact instance (K = V = 1, sympy rationals) with the buffer against the residual.",
        expected="refuted",
        source="package",
        check=check_contraction,
    ),
]
