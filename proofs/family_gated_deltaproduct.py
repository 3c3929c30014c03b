"""GatedDeltaProduct (fla's ``GatedDeltaProduct`` layer; docs/families.md): one token's contraction.

Notation: state ``S ∈ R^{V×K}``, a token's gate ``α`` and its ``n`` micro-steps ``j = 0 … n−1`` with
keys ``k_j``, values ``v_j``, gains ``β_j``; ``S_{−1} = α S`` (the gate acts on micro-step 0 only),
``S_j = S_{j−1} + β_j (v_j − S_{j−1} k_j) k_jᵀ``; micro-step loss ``f_j(X) = ½‖X k_j − v_j‖²``; write
gain ``a_j = β_j‖k_j‖²``.

What is proved, every entry of ``S``, the keys and values and every ``β_j`` and ``α`` a free symbol,
for n = 1..2, K = 1..2, V = 1..2:

(a) each micro-step contracts its own loss as one delta-rule write does (Lemma 4.1 with d ≡ 1):
    ``f_j(S_j) = (1 − a_j)² f_j(S_{j−1})``, the state before micro-step 0 being the *decayed* one;
(b) hence the token's post-decay ratio, the product of its micro-steps' ratios, is
    ``Π_j (1 − a_j)²`` wherever every ``f_j(S_{j−1}) ≠ 0`` (checked as ``Π_j f_j(S_j) =
    Π_j (1 − a_j)² · Π_j f_j(S_{j−1})``, a polynomial identity);
(c) the micro-steps' order matters for the state but not for (a): with n = 2 the two orders give
    different states in general (a witness: K = V = 1, exact rationals), so a record must keep
    fla's order (micro-step j of token t at row t·n + j).

The pre-decay ratio at micro-step 0, ``f_0(S_0)/f_0(S)``, has no closed form in the write gain (it
depends on ``α`` and the state), as for Gated DeltaNet.
"""

from __future__ import annotations

import sympy as sp

from ._claims import Claim, Outcome, conclude
from ._evidence import Witness, derive, format_sizes
from ._sym import all_vanish, indexed, matrix, vanishes, vector

__all__ = ["CLAIMS", "GRID", "micro_steps", "token_steps"]

GRID = {"n": (1, 2), "K": (1, 2), "V": (1, 2)}


def micro_steps(S, alpha, keys, values, betas):
    """The states ``[S_{−1}, S_0, …, S_{n−1}]`` of one token (``S_{−1} = α S``)."""
    states = [alpha * S]
    for k, v, b in zip(keys, values, betas):
        X = states[-1]
        states.append(X + b * (v - X * k) * k.T)
    return states


def _loss(X, k, v):
    r = X * k - v
    return (r.T * r)[0] / 2


def token_steps(n: int, K: int, V: int) -> dict[str, bool]:
    S = matrix("S", V, K, real=True)
    alpha = sp.Symbol("alpha", real=True)
    keys = [vector(f"k{j}_", K, real=True) for j in range(n)]
    values = [vector(f"v{j}_", V, real=True) for j in range(n)]
    betas = indexed("beta", n, real=True)
    states = micro_steps(S, alpha, keys, values, betas)
    steps: dict[str, bool] = {}
    before, after, gains = [], [], []
    for j, (k, v, b) in enumerate(zip(keys, values, betas)):
        a = b * (k.T * k)[0]
        fb, fa = _loss(states[j], k, v), _loss(states[j + 1], k, v)
        before.append(fb)
        after.append(fa)
        gains.append((1 - a) ** 2)
        steps[f"micro-step {j}: S_j k_j − v_j = −(1 − a_j)(v_j − S_(j−1) k_j)"] = all_vanish(
            states[j + 1] * k - v + (1 - a) * (v - states[j] * k)
        )
        steps[f"micro-step {j}: f_j(S_j) = (1 − a_j)² f_j(S_(j−1))"] = vanishes(fa, (1 - a) ** 2 * fb)
    steps["token: Π_j f_j(S_j) = Π_j (1 − a_j)² · Π_j f_j(S_(j−1))"] = vanishes(
        sp.Mul(*after), sp.Mul(*gains) * sp.Mul(*before)
    )
    return steps


def order_witness() -> Witness:
    """K = V = 1, n = 2: swapping the two micro-steps changes the state."""
    S, alpha = sp.Matrix([[1]]), sp.Integer(1)
    k0, k1 = sp.Matrix([[1]]), sp.Matrix([[sp.Rational(1, 2)]])
    v0, v1 = sp.Matrix([[2]]), sp.Matrix([[-1]])
    b0, b1 = sp.Rational(1, 2), sp.Integer(1)
    forward = micro_steps(S, alpha, [k0, k1], [v0, v1], [b0, b1])[-1][0, 0]
    swapped = micro_steps(S, alpha, [k1, k0], [v1, v0], [b1, b0])[-1][0, 0]
    return Witness(
        label="micro-step order changes the state (K = V = 1, exact)",
        lhs=forward, op="!=", rhs=swapped,
        instance={"S": 1, "alpha": 1, "k": "(1, 1/2)", "v": "(2, -1)", "beta": "(1/2, 1)"},
        sizes={"K": 1, "V": 1, "n": 2},
    )


def check_token_contraction() -> Outcome:
    proof = derive("one token of n micro-steps", token_steps, **GRID)
    return conclude(
        "Each micro-step of a GatedDeltaProduct token contracts its own loss by (1 − β_j‖k_j‖²)² against "
        "the state just before it (the decayed state for micro-step 0), for any keys; so the token's "
        "post-decay ratio, the product of its micro-steps' ratios, is Π_j (1 − β_j‖k_j‖²)² "
        f"({format_sizes(proof.sizes)}, every entry symbolic). The micro-steps do not commute.",
        [proof, order_witness()],
        numbers={"n_checked": "1..2"},
    )


CLAIMS = [
    Claim(
        id="gdp-micro-step-contraction",
        location="Lemma 4.1 (Sec. 4.2), applied to each micro-step of fla 0.6.0's GatedDeltaProduct layer "
        "(docs/families.md; the paper does not treat this family)",
        quote="Lemma 4.1 (Closed-form hypergradient). For any d t ∈ ℝ K , β t ∈ ( 0 , 1 ) , and k t ≠ 0",
        statement="For a GatedDeltaProduct token with gate α and micro-steps (k_j, v_j, β_j), f_j(S_j) = "
        "(1 − β_j‖k_j‖²)² f_j(S_{j−1}) with S_{−1} = αS_{t−1}, so the token's post-decay ratio Π_j q_j^post "
        "= Π_j (1 − β_j‖k_j‖²)² where every f_j(S_{j−1}) ≠ 0; the micro-steps' order matters for the state.",
        method=f"sympy, {format_sizes(GRID)}: the residual identity and the loss identity per micro-step, "
        "and the token product, expand to 0; an exact K = V = 1 witness for the order.",
        expected="verified",
        source="package",
        check=check_token_contraction,
    ),
]
