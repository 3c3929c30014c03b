"""RWKV-7's generalised delta rule (fla's ``RWKV7Attention``): what Lemma 4.1 becomes for one token.

Notation (state ``S ∈ R^{V×K}``, as the replay): removal key ``κ̂``, in-context rate ``α``, erase
vector ``b = κ̂ ⊙ α``, write key ``k``, value ``v``, per-channel decay ``D = Diag(exp(w))``. One token:

    S' = S D − (S κ̂) bᵀ + v kᵀ.

On the removal key (the replay's loss ``½‖S κ̂ − v‖²``), with ``c_b = ⟨b, κ̂⟩ = Σ α_i κ̂_i²`` (the record's
β) and ``c_k = ⟨k, κ̂⟩``, without decay (``D = I``):

    S'κ̂ − v = (1 − c_b) S κ̂ − (1 − c_k) v,

a closed form in the token's own prediction ``S κ̂``; when the write key's projection on κ̂ equals the
erase gain (``c_k = c_b = c``) it is ``(1 − c)(S κ̂ − v)`` and ``q = (1 − c)²``, Lemma 4.1's form. With decay
the erase reads the pre-decay prediction ``S κ̂`` and the residual the decayed one ``S D κ̂``: no
closed form in one prediction.

(a) The identity for K = 1..3, V = 1..2, every entry symbolic, and the reduction at ``c_k = c_b``
    (``k = κ̂ ⊙ α + z`` with ``z ⊥ κ̂``, here ``z`` symbolic with ``⟨z, κ̂⟩`` eliminated).
(b) Corollary A.2's conclusion does not carry over: a write key pointing against κ̂ raises the loss
    (an exact instance with ``α = 1/2`` and ``q = 4``).
"""

from __future__ import annotations

import sympy as sp

from ._claims import Claim, conclude
from ._evidence import Counterexample, derive, format_sizes
from ._sym import all_vanish, dot, matrix, vanishes, vector

__all__ = ["CLAIMS", "GRID", "one_token_steps"]

GRID = {"K": (1, 2, 3), "V": (1, 2)}


def one_token_steps(K: int, V: int) -> dict[str, bool]:
    S = matrix("S", V, K, real=True)
    kh, alpha, k = vector("kappa", K, real=True), vector("alpha", K, real=True), vector("k", K, real=True)
    v = vector("v", V, real=True)
    b = kh.multiply_elementwise(alpha)
    S_new = S - (S * kh) * b.T + v * k.T
    c_b, c_k = dot(b, kh), dot(k, kh)
    after = S_new * kh - v
    steps = {
        "S'κ̂ − v = (1 − c_b)Sκ̂ − (1 − c_k)v (no decay)": all_vanish(after, (1 - c_b) * S * kh - (1 - c_k) * v),
    }
    # c_k = c_b: the write key is b plus a part z orthogonal to κ̂ (its last coordinate solved for).
    z = vector("z", K, real=True)
    if K > 1:
        last = sp.solve(sp.Eq(dot(z, kh), 0), z[K - 1], dict=True)
        z = z.subs(z[K - 1], last[0][z[K - 1]]) if last else z
        k_eq = b + z
        at = {k[i]: k_eq[i] for i in range(K)}
        after_eq = after.subs(at, simultaneous=True)
        steps["c_k = c_b: S'κ̂ − v = (1 − c_b)(Sκ̂ − v)"] = all_vanish(after_eq, (1 - c_b) * (S * kh - v))
        steps["c_k = c_b: ‖S'κ̂ − v‖² = (1 − c_b)²‖Sκ̂ − v‖² (Lemma 4.1)"] = vanishes(
            dot(after_eq, after_eq), (1 - c_b) ** 2 * dot(S * kh - v, S * kh - v))
    else:  # K = 1: c_k = c_b means k = b
        after_eq = after.subs(k[0], b[0])
        steps["c_k = c_b: S'κ̂ − v = (1 − c_b)(Sκ̂ − v)"] = all_vanish(after_eq, (1 - c_b) * (S * kh - v))
    return steps


def check_one_token():
    proof = derive("one RWKV-7 write without decay, every entry symbolic", one_token_steps, **GRID)
    return conclude(
        "S'κ̂ − v = (1 − ⟨b, κ̂⟩)Sκ̂ − (1 − ⟨k, κ̂⟩)v without decay, and = (1 − c)(Sκ̂ − v) when the write key's "
        f"projection on κ̂ equals the erase gain c = Σα κ̂² ({format_sizes(proof.sizes)}, every entry symbolic): "
        "then q = (1 − c)², Lemma 4.1's form.",
        [proof],
    )


def check_contraction():
    half = sp.Rational(1, 2)
    # K = V = 1: κ̂ = 1, α = 1/2 (c_b = 1/2), write key k = −1, S = 0, v = 1, no decay.
    S, kh, alpha, k, v = sp.Integer(0), sp.Integer(1), half, sp.Integer(-1), sp.Integer(1)
    after = (S - (S * kh) * (kh * alpha) + v * k) * kh - v
    before = S * kh - v
    q = after**2 / before**2
    ce = Counterexample(
        "α = 1/2, write key against κ̂", lhs=q, op="<", rhs=1,
        instance={"S": S, "kappa": kh, "alpha": alpha, "k": k, "v": v, "w": 0},
        sizes={"K": (1,), "V": (1,)}, steps={"0 < α < 1": bool(0 < alpha < 1), "‖κ̂‖ = 1": kh**2 == 1},
    )
    return conclude(
        f"With a unit removal key, α = 1/2 and a write key pointing against it, the residual goes from "
        f"{before} to {after}: q = {q} > 1. An RWKV-7 write need not contract the removal-key loss.",
        [ce],
        numbers={"q": str(q)},
    )


CLAIMS = [
    Claim(
        id="rwkv7-one-token-ratio",
        location="Lemma 4.1, asked of fla 0.6.0's RWKV7Attention (fla/ops/rwkv7)",
        quote="Lemma 4.1 (Closed-form hypergradient). For any d t ∈ ℝ K , β t ∈ ( 0 , 1 ) , and k t ≠ 0",
        statement="Without decay one RWKV-7 write gives S'κ̂ − v = (1 − ⟨b, κ̂⟩)Sκ̂ − (1 − ⟨k, κ̂⟩)v; with "
        "⟨k, κ̂⟩ = ⟨b, κ̂⟩ = c the removal-key ratio is (1 − c)².",
        method=f"sympy, {format_sizes(GRID)}: the write expanded entrywise against the closed form; the "
        "case c_k = c_b by writing k = b + z with z ⊥ κ̂.",
        expected="verified",
        source="package",
        check=check_one_token,
    ),
    Claim(
        id="rwkv7-writes-contract",
        location="Corollary A.2's conclusion, asked of fla 0.6.0's RWKV7Attention",
        quote="Corollary A.2 (Monotone descent under bounded box).",
        statement="Every RWKV-7 write with a unit removal key and rates α ∈ (0, 1)ᴷ contracts the "
        "removal-key loss (q < 1).",
        method="an exact instance (K = V = 1, sympy rationals) with the write key against κ̂.",
        expected="refuted",
        source="package",
        check=check_contraction,
    ),
]
