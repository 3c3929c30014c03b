"""Comba (fla 0.6.0's ``chunk_comba`` / ``fused_recurrent_comba``): the one-token contraction.

Notation: state ``S ∈ R^{V×K}``, removal (read) key ``p``, write key ``k``, value ``v``, gate ``β``,
decay ``α = exp(g)``. The kernels take the residual against the state before the decay,
``u = v − S p``, and write ``S' = α S + β u kᵀ``; the token loss the residual is the error of is
``f(S) = ½‖S p − v‖²`` (docs/families.md, "Comba").

(a) Without decay (``α = 1``): ``∇f(S) = −u pᵀ`` (by entrywise differentiation), the write's inner
    product with the negative gradient is ``⟨u kᵀ, u pᵀ⟩ = ‖u‖²⟨k, p⟩`` (a descent direction exactly
    when ``⟨k, p⟩ > 0``), ``S' p − v = −(1 − a) u`` with ``a = β⟨k, p⟩``, so
    ``f(S') = (1 − a)² f(S)``: Lemma 4.1's form with the write gain ``β⟨k, p⟩``.
(b) With decay: ``S' p − v = −(α − a) u − (1 − α) v``, so ``f(S') = ½‖(α − a) u + (1 − α) v‖²``, and
    the post-decay loss is ``f(αS) = ½‖α u + (1 − α) v‖²``; neither ratio has a closed form in
    ``a`` alone (it depends on the angle between ``u`` and ``v``) — the additive ``(1 − α)v`` term
    App. B.1 warns a pre-gate residual brings, which Comba's kernels take.

Checked for K = 1..3, V = 1..2 with every entry symbolic.
"""

from __future__ import annotations

import sympy as sp

from ._claims import Claim, Outcome, conclude
from ._evidence import derive, format_sizes, format_values
from ._sym import all_vanish, matrix, vanishes, vector

__all__ = ["CLAIMS", "GRID", "gated_steps", "ungated_steps"]

#: sizes of the identities
GRID = {"K": (1, 2, 3), "V": (1, 2)}


def _symbols(K: int, V: int):
    S, v = matrix("S", V, K, real=True), vector("v", V, real=True)
    p, k = vector("p", K, real=True), vector("k", K, real=True)
    return S, v, p, k, sp.Symbol("beta", real=True)


def _f(S, p, v):
    r = S * p - v
    return (r.T * r)[0] / 2


def ungated_steps(K: int, V: int) -> dict[str, bool]:
    """(a) for one write with every entry symbolic."""
    S, v, p, k, beta = _symbols(K, V)
    u = v - S * p
    a = beta * (k.T * p)[0]
    S1 = S + beta * u * k.T
    grad = sp.Matrix(V, K, lambda i, j: sp.diff(_f(S, p, v), S[i, j]))
    return {
        "∇f(S) = −u pᵀ": all_vanish(grad + u * p.T),
        "⟨u kᵀ, −∇f(S)⟩ = ‖u‖²⟨k, p⟩": vanishes(
            sum((u * k.T).multiply_elementwise(-grad)), (u.T * u)[0] * (k.T * p)[0]
        ),
        "S'p − v = −(1 − a) u": all_vanish(S1 * p - v + (1 - a) * u),
        "f(S') = (1 − a)² f(S)": vanishes(_f(S1, p, v), (1 - a) ** 2 * _f(S, p, v)),
    }


def gated_steps(K: int, V: int) -> dict[str, bool]:
    """(b) for one gated write with every entry symbolic."""
    S, v, p, k, beta = _symbols(K, V)
    alpha = sp.Symbol("alpha", positive=True)
    u = v - S * p
    a = beta * (k.T * p)[0]
    S1 = alpha * S + beta * u * k.T
    w_after = (alpha - a) * u + (1 - alpha) * v
    w_decayed = alpha * u + (1 - alpha) * v
    return {
        "S'p − v = −(α − a) u − (1 − α) v": all_vanish(S1 * p - v + w_after),
        "f(S') = ½‖(α − a) u + (1 − α) v‖²": vanishes(_f(S1, p, v), (w_after.T * w_after)[0] / 2),
        "f(αS) = ½‖α u + (1 − α) v‖²": vanishes(_f(alpha * S, p, v), (w_decayed.T * w_decayed)[0] / 2),
    }


def check_ungated() -> Outcome:
    proof = derive("one ungated Comba write", ungated_steps, **GRID)
    return conclude(
        "With u = v − Sp and S' = S + βu kᵀ: ∇f(S) = −u pᵀ, the write's inner product with −∇f is "
        "‖u‖²⟨k, p⟩, S'p − v = −(1 − a)u and f(S') = (1 − a)² f(S) with a = β⟨k, p⟩ "
        f"({format_sizes(proof.sizes)}, every entry symbolic).",
        [proof],
        numbers={"K_checked": format_values(proof.sizes["K"])},
    )


def check_gated() -> Outcome:
    proof = derive("one gated Comba write", gated_steps, **GRID)
    return conclude(
        "With S' = αS + βu kᵀ and u = v − Sp (before the decay): S'p − v = −(α − a)u − (1 − α)v, "
        "f(S') = ½‖(α − a)u + (1 − α)v‖² and f(αS) = ½‖αu + (1 − α)v‖² "
        f"({format_sizes(proof.sizes)}, every entry symbolic).",
        [proof],
        numbers={"K_checked": format_values(proof.sizes["K"])},
    )


CLAIMS = [
    Claim(
        id="comba-one-token-contraction",
        location="Sec. 4.2, Lemma 4.1, for fla's Comba (ops/comba)",
        quote="Lemma 4.1 (Closed-form hypergradient). For any d t ∈ ℝ K , β t ∈ ( 0 , 1 ) , and k t ≠ 0",
        statement="Without decay, one Comba write (residual along p, write along k) contracts the loss "
        "½‖Sp − v‖² by exactly (1 − β⟨k, p⟩)², and is a descent step on it when ⟨k, p⟩ > 0.",
        method=f"sympy, {format_sizes(GRID)}: ∇f by entrywise differentiation; the identities subtracted "
        "entrywise expand to 0.",
        expected="verified",
        source="package",
        check=check_ungated,
    ),
    Claim(
        id="comba-gated-one-token",
        location="App. B.1 (pre-gate residual), for fla's Comba",
        quote="Using the pre-gate residual would introduce an additive ( 1 − α t ) 𝐯 t term that is not "
        "controlled by d t",
        statement="With decay α and the residual taken before it (as Comba's kernels take it), one Comba "
        "write leaves f(S') = ½‖(α − β⟨k, p⟩)u + (1 − α)v‖² and f(αS) = ½‖αu + (1 − α)v‖²: the additive "
        "(1 − α)v term of a pre-gate residual, so no closed form in β⟨k, p⟩ alone.",
        method=f"sympy, {format_sizes(GRID)}: the identities subtracted entrywise expand to 0.",
        expected="verified",
        source="package",
        check=check_gated,
    ),
]
