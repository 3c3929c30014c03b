"""The chunkwise (WY / UT-transform) forms of the asymmetric delta rule equal the token recurrence.

Notation: a chunk of C tokens; ``K, K̃ ∈ R^{C×K}`` stack the read keys ``k_i`` and write keys ``k̃_i``
(row i = token i), ``V ∈ R^{C×V}`` the values, ``B = diag(β)``; chunk-start state ``S``. Every entry
is an independent symbol — in particular ``k̃_i`` is *not* tied to ``d ⊙ k_i``, so the identities hold
for any write key.

* App. A.2, Eq. 8–11 (DeltaNet convention, ``S ∈ R^{V×K}``): token rule
  ``S ← S + β_i (v_i − S k_i) k̃_iᵀ``; chunk form ``T = (I + tril(B K K̃ᵀ, −1))⁻¹``, ``W = T B K``,
  ``U = T B V``, ``S_next = S + (U − W Sᵀ)ᵀ K̃``, and ``Π_i (I − β_i k_i k̃_iᵀ) = I − Wᵀ K̃`` (Eq. 10).
* App. B.1, Eq. 13–15 (Gated DeltaNet, scalar decay ``α_i``, ``γ_i = Π_{l≤i} α_l``): token rule
  ``S̄ = α_i S``, ``S ← S̄ + β_i (v_i − S̄ k_i) k̃_iᵀ``; chunk form
  ``M = (I + strictLower(B (γ⊙K)(K̃/γ)ᵀ))⁻¹ B``, ``W = M(γ⊙K)``, ``U = M V``,
  ``S_next = γ_C S + (U − W Sᵀ)ᵀ(ρ ⊙ K̃)`` with ``ρ_i = γ_C/γ_i``.
* App. B.2 (KDA, native ``S ∈ R^{K×V}``, channel decay ``α_i ∈ R^K``, ``Γ_i = Π_{l≤i} α_l``): token rule
  ``S̄ = Diag(α_i) S``, ``S ← S̄ + β_i k̃_i (v_i − S̄ᵀ k_i)ᵀ``; chunk form
  ``M = (I + StrictTril(B (Γ⊙K)(K̃/Γ)ᵀ))⁻¹ B``, ``W = M(Γ⊙K)``, ``U = M V``,
  ``S_next = Diag(γ_C) S + (Γ^{i→C} ⊙ K̃)ᵀ(U − W S)``.

The unit lower-triangular inverse is computed by forward substitution (and checked: ``T (I + A) = I``).
Differences are compared entrywise after clearing denominators (decays are positive symbols).
Chunk sizes checked: plain C = 2, 3, 4 (K = 2, V = 2); gated and KDA C = 2, 3 (K = 2, V = 1). The
forms are proved for those sizes; that they hold for every C is the standard induction of the WY
representation, which these cases instantiate. A supporting fp64 sweep up to the paper's chunk size 64
(:mod:`._sweep`) is reported in the numbers, not among the evidence.
"""

from __future__ import annotations

import sympy as sp

from ._claims import Claim, Outcome, conclude
from ._evidence import derive, format_sizes, format_values
from ._sweep import supporting
from ._sym import all_vanish, indexed, matrix

__all__ = [
    "CLAIMS",
    "GATED",
    "KDA",
    "PLAIN",
    "chunk_state",
    "gated_chunk_state",
    "kda_chunk_state",
    "kda_token_state",
    "token_state",
    "unit_lower_inverse",
]


def unit_lower_inverse(L: sp.Matrix) -> sp.Matrix:
    """Inverse of a unit lower-triangular matrix by forward substitution (row i of ``L X = I``)."""
    n = L.rows
    X = sp.zeros(n, n)
    for i in range(n):
        row = sp.eye(n)[i, :]
        for j in range(i):
            row -= L[i, j] * X[j, :]
        X[i, :] = row
    return X


def _strict_lower(A: sp.Matrix) -> sp.Matrix:
    return sp.Matrix(A.rows, A.cols, lambda i, j: A[i, j] if j < i else 0)


def _row(M: sp.Matrix, i: int) -> sp.Matrix:
    return M[i, :].T


def token_state(S, K, Kt, V, beta, alpha=None) -> sp.Matrix:
    """Token-by-token asymmetric (optionally scalar-gated) delta rule, ``S ∈ R^{V×K}``."""
    for i in range(K.rows):
        S_bar = S if alpha is None else alpha[i] * S
        S = S_bar + beta[i] * (_row(V, i) - S_bar * _row(K, i)) * _row(Kt, i).T
    return S


def chunk_state(S, K, Kt, V, beta, *, symmetric_gram: bool = False) -> sp.Matrix:
    """Eq. 8–11. ``symmetric_gram=True`` uses DeltaNet's ``K Kᵀ`` Gram instead (a wrong variant,
    kept to show that the check can tell the two apart)."""
    B = sp.diag(*beta)
    gram = B * K * (K if symmetric_gram else Kt).T
    T = unit_lower_inverse(sp.eye(K.rows) + _strict_lower(gram))
    W, U = T * B * K, T * B * V
    return S + (U - W * S.T).T * Kt


def gated_chunk_state(S, K, Kt, V, beta, alpha) -> sp.Matrix:
    """Eq. 13–15 (decay-ratio gauge)."""
    C = K.rows
    gamma = [sp.Mul(*alpha[: i + 1]) for i in range(C)]
    G, G_inv = sp.diag(*gamma), sp.diag(*[1 / g for g in gamma])
    B = sp.diag(*beta)
    M = unit_lower_inverse(sp.eye(C) + _strict_lower(B * (G * K) * (G_inv * Kt).T)) * B
    W, U = M * (G * K), M * V
    rho = sp.diag(*[gamma[-1] / g for g in gamma])
    return gamma[-1] * S + (U - W * S.T).T * (rho * Kt)


def kda_token_state(S, K, Kt, V, beta, A) -> sp.Matrix:
    """KDA with write key ``k̃``, ``S ∈ R^{K×V}``; row i of ``A`` is the channel decay ``α_i``."""
    for i in range(K.rows):
        S_bar = sp.diag(*A[i, :]) * S
        S = S_bar + beta[i] * _row(Kt, i) * (_row(V, i) - S_bar.T * _row(K, i)).T
    return S


def kda_chunk_state(S, K, Kt, V, beta, A) -> sp.Matrix:
    """App. B.2 chunk form with cumulative channel decays ``Γ``."""
    C, dk = K.shape
    Gam = sp.Matrix(C, dk, lambda i, j: sp.Mul(*[A[l, j] for l in range(i + 1)]))
    gC = Gam[C - 1, :]
    B = sp.diag(*beta)
    GK = Gam.multiply_elementwise(K)
    Kt_over = sp.Matrix(C, dk, lambda i, j: Kt[i, j] / Gam[i, j])
    M = unit_lower_inverse(sp.eye(C) + _strict_lower(B * GK * Kt_over.T)) * B
    W, U = M * GK, M * V
    suffix = sp.Matrix(C, dk, lambda i, j: gC[j] / Gam[i, j])
    return sp.diag(*gC) * S + suffix.multiply_elementwise(Kt).T * (U - W * S)


def _chunk_symbols(C: int, dk: int, dv: int, kda: bool = False):
    S = matrix("S", dk, dv) if kda else matrix("S", dv, dk)
    return S, matrix("k", C, dk), matrix("kt", C, dk), matrix("v", C, dv), indexed("beta", C)


def plain_steps(C: int, K: int = 2, V: int = 2) -> dict[str, bool]:
    """Eq. 10–11 for one chunk of C tokens; ``K``, ``V``: the key and value sizes."""
    dk, dv = K, V
    S, K, Kt, V, beta = _chunk_symbols(C, dk, dv)  # from here on K, V are the stacked C×· matrices
    B = sp.diag(*beta)
    L = sp.eye(C) + _strict_lower(B * K * Kt.T)
    T = unit_lower_inverse(L)
    P = sp.eye(dk)
    for i in range(C):
        P = P * (sp.eye(dk) - beta[i] * _row(K, i) * _row(Kt, i).T)
    chunk_minus_tokens = chunk_state(S, K, Kt, V, beta) - token_state(S, K, Kt, V, beta)
    return {
        "T(I + A) = I": all_vanish(T * L, sp.eye(C)),
        "Eq. 11 state = token recurrence": all_vanish(chunk_minus_tokens),
        "Eq. 10 Π(I − β k k̃ᵀ) = I − WᵀK̃": all_vanish(P, sp.eye(dk) - (T * B * K).T * Kt),
    }


def gated_steps(C: int, K: int = 2, V: int = 1) -> dict[str, bool]:
    """Eq. 15 for one chunk of C tokens; ``K``, ``V``: the key and value sizes."""
    dk, dv = K, V
    S, K, Kt, V, beta = _chunk_symbols(C, dk, dv)  # from here on K, V are the stacked C×· matrices
    alpha = indexed("alpha", C, positive=True)
    diff = gated_chunk_state(S, K, Kt, V, beta, alpha) - token_state(S, K, Kt, V, beta, alpha)
    return {"Eq. 15 state = gated token recurrence": all_vanish(diff)}


def kda_steps(C: int, K: int = 2, V: int = 1) -> dict[str, bool]:
    """The KDA chunk form for one chunk of C tokens; ``K``, ``V``: the key and value sizes."""
    dk, dv = K, V
    S, K, Kt, V, beta = _chunk_symbols(C, dk, dv, kda=True)  # from here on K, V are C×· matrices
    A = matrix("alpha", C, dk, positive=True)
    diff = kda_chunk_state(S, K, Kt, V, beta, A) - kda_token_state(S, K, Kt, V, beta, A)
    return {"KDA chunk state = token recurrence": all_vanish(diff)}


#: chunk sizes C and key/value sizes K, V checked for each form
PLAIN = {"C": (2, 3, 4), "K": (2,), "V": (2,)}
GATED = {"C": (2, 3), "K": (2,), "V": (1,)}
KDA = {"C": (2, 3), "K": (2,), "V": (1,)}


def _numbers(sizes: dict, kind: str) -> tuple[dict, str]:
    """The claim's numbers, with the supporting fp64 sweep of :mod:`._sweep`, and the sentence on it."""
    extra, sentence = supporting(kind)
    return {"C_checked": format_values(sizes["C"]), "K": sizes["K"][0], "V": sizes["V"][0], **extra}, sentence


def check_plain() -> Outcome:
    proof = derive("chunk form vs token recurrence", plain_steps, **PLAIN)
    numbers, supporting = _numbers(proof.sizes, "plain")
    return conclude(
        f"For {format_sizes(proof.sizes)} (all entries symbolic, write keys independent of read keys) the "
        "WY chunk state S + (U − WSᵀ)ᵀK̃ equals the token-by-token asymmetric delta rule, the "
        "forward-substitution T inverts I + tril(BKK̃ᵀ, −1), and Π(I − β_i k_i k̃_iᵀ) = I − WᵀK̃."
        + supporting,
        [proof],
        numbers=numbers,
    )


def check_gated() -> Outcome:
    proof = derive("gated chunk form vs token recurrence", gated_steps, **GATED)
    numbers, supporting = _numbers(proof.sizes, "gated")
    return conclude(
        f"For {format_sizes(proof.sizes)} (positive symbolic decays) the decay-ratio chunk form "
        "γ_C S + (U − WSᵀ)ᵀ(ρ ⊙ K̃) equals the gated token recurrence S̄ = α_i S, "
        "S ← S̄ + β_i(v_i − S̄k_i)k̃_iᵀ exactly."
        + supporting,
        [proof],
        numbers=numbers,
    )


def check_kda() -> Outcome:
    proof = derive("KDA chunk form vs token recurrence", kda_steps, **KDA)
    numbers, supporting = _numbers(proof.sizes, "kda")
    return conclude(
        f"For {format_sizes(proof.sizes)} (K = d_k, V = d_v; positive symbolic channel decays) the KDA "
        "chunk form Diag(γ_C)S + (Γ^{i→C} ⊙ K̃)ᵀ(U − WS) equals the token recurrence with write key k̃ exactly."
        + supporting,
        [proof],
        numbers=numbers,
    )


CLAIMS = [
    Claim(
        id="wy-chunk-asymmetric",
        location="Sec. 4.3 Eq. (5)–(6); App. A.2 Eq. (8)–(11)",
        quote="The chunk-internal cumulative transition admits the asymmetric WY form",
        statement="The asymmetric WY chunk form (Gram B K K̃ᵀ, T by forward substitution, "
        "W = TBK, U = TBV, S_next = S + (U − WSᵀ)ᵀK̃) reproduces the token recurrence.",
        method="sympy: chunk state minus token-by-token state expands to 0 entrywise, "
        f"{format_sizes(PLAIN)}; also T(I + A) = I and Eq. (10); supporting fp64 sweep (numpy) up to chunk size 64.",
        expected="verified",
        check=check_plain,
    ),
    Claim(
        id="wy-chunk-gated",
        location="App. B.1, Eq. (13)–(15)",
        quote="We use the standard Gated DeltaNet decay-ratio gauge",
        statement="The gated (OSGDN) chunk form with decay ratios γ_i/γ_j reproduces the gated token "
        "recurrence with write key k̃.",
        method=f"sympy: chunk minus token state, denominators cleared, expands to 0; {format_sizes(GATED)}; "
        "supporting fp64 sweep up to chunk size 64.",
        expected="verified",
        check=check_gated,
    ),
    Claim(
        id="wy-chunk-kda",
        location="App. B.2 (OSKDA chunkwise UT transform)",
        quote="For hardware-efficient training, the storage-side substitution is reflected in KDA’s "
        "chunkwise UT-transform.",
        statement="The OSKDA chunk form with channel-wise cumulative decays Γ reproduces KDA's token "
        "recurrence with write key k̃ (native K×V state).",
        method=f"sympy: chunk minus token state, denominators cleared, expands to 0; {format_sizes(KDA)}; "
        "supporting fp64 sweep up to chunk size 64.",
        expected="verified",
        check=check_kda,
    ),
]
