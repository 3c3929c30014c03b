"""GDN-2 (fla 0.6.0's ``chunk_gdn2`` / ``fused_recurrent_gdn2``): the one-token contraction.

Notation (``V×K`` state): ``S ∈ R^{V×K}``, key ``k``, value ``v``, channel decay ``α ∈ R^K``
(``S̄ = S·Diag(α)``), erase gate ``b ∈ R^K``, write gate ``w ∈ R^V``. The kernels compute
``u = w ⊙ v − S̄(b ⊙ k)`` and write ``S' = S̄ + u kᵀ``: the delta rule with read key ``b ⊙ k``,
target ``w ⊙ v``, β = 1 and write key ``k``. The token loss whose residual this is:
``f(S) = ½‖S(b ⊙ k) − w ⊙ v‖²`` (docs/families.md, "GDN-2").

(a) ``∇f(S̄) = −u (b ⊙ k)ᵀ``; the write's inner product with ``−∇f(S̄)`` is ``‖u‖²⟨b, k ⊙ k⟩`` (a descent
    direction for ``b ≥ 0``); ``S'(b ⊙ k) − w ⊙ v = −(1 − a) u`` with ``a = ⟨b, k ⊙ k⟩``, so
    ``f(S') = (1 − a)² f(S̄)``: Lemma 4.1's form with ``d = b``, β = 1, against the decayed state.
(b) With scalar gates ``b = w = β·1`` (KDA): ``f(S) = β² · ½‖S k − v‖²``, so every ratio of the GDN-2
    loss is the KDA ratio of the same state.

Checked for K = 1..3, V = 1..2 with every entry symbolic.
"""

from __future__ import annotations

import sympy as sp

from ._claims import Claim, Outcome, conclude
from ._evidence import derive, format_sizes, format_values
from ._sym import all_vanish, matrix, vanishes, vector

__all__ = ["CLAIMS", "GRID", "kda_steps", "write_steps"]

GRID = {"K": (1, 2, 3), "V": (1, 2)}


def _loss(S, key, target):
    r = S * key - target
    return (r.T * r)[0] / 2


def write_steps(K: int, V: int) -> dict[str, bool]:
    """(a) for one write with every entry symbolic."""
    S, v, k = matrix("S", V, K, real=True), vector("v", V, real=True), vector("k", K, real=True)
    alpha, b, w = vector("alpha", K, positive=True), vector("b", K, real=True), vector("w", V, real=True)
    Sbar = S * sp.diag(*alpha)
    bk, wv = b.multiply_elementwise(k), w.multiply_elementwise(v)
    u = wv - Sbar * bk
    S1 = Sbar + u * k.T
    a = (b.T * k.multiply_elementwise(k))[0]
    grad = sp.Matrix(V, K, lambda i, j: sp.diff(_loss(S, bk, wv), S[i, j])).subs(
        {S[i, j]: Sbar[i, j] for i in range(V) for j in range(K)}, simultaneous=True)
    return {
        "∇f(S̄) = −u (b⊙k)ᵀ": all_vanish(grad + u * bk.T),
        "⟨u kᵀ, −∇f(S̄)⟩ = ‖u‖²⟨b, k⊙k⟩": vanishes(sum((u * k.T).multiply_elementwise(-grad)), (u.T * u)[0] * a),
        "S'(b⊙k) − w⊙v = −(1 − a) u": all_vanish(S1 * bk - wv + (1 - a) * u),
        "f(S') = (1 − a)² f(S̄)": vanishes(_loss(S1, bk, wv), (1 - a) ** 2 * _loss(Sbar, bk, wv)),
    }


def kda_steps(K: int, V: int) -> dict[str, bool]:
    """(b): scalar gates b = w = β·1 scale the loss by β²."""
    S, v, k = matrix("S", V, K, real=True), vector("v", V, real=True), vector("k", K, real=True)
    beta = sp.Symbol("beta", real=True)
    return {"f(S) = β² ½‖Sk − v‖²": vanishes(_loss(S, beta * k, beta * v), beta**2 * _loss(S, k, v))}


def check() -> Outcome:
    proof = derive("one GDN-2 write", write_steps, **GRID)
    kda = derive("scalar gates (KDA)", kda_steps, **GRID)
    return conclude(
        "With S̄ = S·Diag(α), u = w⊙v − S̄(b⊙k), S' = S̄ + u kᵀ and f(S) = ½‖S(b⊙k) − w⊙v‖²: "
        "∇f(S̄) = −u(b⊙k)ᵀ, the write's inner product with −∇f is ‖u‖²⟨b, k⊙k⟩, and "
        "f(S') = (1 − ⟨b, k⊙k⟩)² f(S̄); with b = w = β·1 the loss is β² times KDA's "
        f"({format_sizes(proof.sizes)}, every entry symbolic).",
        [proof, kda],
        numbers={"K_checked": format_values(proof.sizes["K"])},
    )


CLAIMS = [
    Claim(
        id="gdn2-one-token-contraction",
        location="Sec. 4.2, Lemma 4.1, for fla's GDN-2 (ops/gdn2)",
        quote="Lemma 4.1 (Closed-form hypergradient). For any d t ∈ ℝ K , β t ∈ ( 0 , 1 ) , and k t ≠ 0",
        statement="One GDN-2 write contracts ½‖S(b⊙k) − w⊙v‖² against the decayed state by exactly "
        "(1 − ⟨b, k⊙k⟩)² (Lemma 4.1 with d = b, β = 1), is a descent step on it for b ≥ 0, and with "
        "scalar gates b = w = β gives KDA's ratios.",
        method=f"sympy, {format_sizes(GRID)}: ∇f by entrywise differentiation at S̄; the identities "
        "subtracted entrywise expand to 0.",
        expected="verified",
        source="package",
        check=check,
    ),
]
