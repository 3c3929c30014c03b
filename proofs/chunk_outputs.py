"""The chunkwise *outputs*: Eq. (6)/Listing 1's intra-chunk score, Listing 2's gated output, App. B.2's
OSKDA output — each against the token recurrence's read-out.

Notation as in :mod:`.wy_chunk`: one chunk of C tokens, stacked queries ``Q``, read keys ``K``, write keys
``K̃`` (independent symbols), values ``V``, gates ``B = diag(β)``, chunk-start state ``S``; ``tril``
keeps the diagonal. DeltaNet/GDN states are ``V × K`` and token ``i`` reads ``o_i = S_i q_i`` *after* its
write; KDA states are ``K × V`` and read ``o_i = S_iᵀ q_i``.

* Listing 1 (Eq. 6, App. A.2): ``O = Q Sᵀ + tril(Q K̃ᵀ)(U − W Sᵀ)`` with ``W = T B K``, ``U = T B V``.
* Listing 2 (App. C, OSGDN): ``O = (γ⊙Q) Sᵀ + tril((γ⊙Q)(K̃/γ)ᵀ)(U − W Sᵀ)`` with ``U = M V``,
  ``W = M(γ⊙K)`` and ``M`` of Eq. (13).
* App. B.2 (OSKDA): ``O = (Γ⊙Q) S + Tril((Γ⊙Q)(K̃/Γ)ᵀ)(U − W S)``.

Checked with every entry symbolic for C = 2..4 (K = 2, V = 1; decays positive symbols); the token
rows are compared entrywise after clearing denominators. Also checked: replacing K̃ by K in the score
(the symmetric DeltaNet score) is *not* the OSDN output. A supporting fp64 sweep (:mod:`._sweep`, chunks
of 2 to 64 tokens, key size 16, value size 8) is reported in the numbers and is not part of the evidence.
"""

from __future__ import annotations

import sympy as sp

from ._claims import Claim, Outcome, conclude
from ._evidence import derive, format_sizes, format_values
from ._sweep import supporting
from ._sym import all_vanish, matrix
from .wy_chunk import unit_lower_inverse

__all__ = [
    "CLAIMS",
    "GRID",
    "gated_chunk_output",
    "kda_chunk_output",
    "plain_chunk_output",
    "token_outputs",
]

#: chunk sizes and key/value sizes of the symbolic checks
GRID = {"C": (2, 3, 4), "K": (2,), "V": (1,)}


def _strict_lower(A: sp.Matrix) -> sp.Matrix:
    return sp.Matrix(A.rows, A.cols, lambda i, j: A[i, j] if j < i else 0)


def _lower(A: sp.Matrix) -> sp.Matrix:
    return sp.Matrix(A.rows, A.cols, lambda i, j: A[i, j] if j <= i else 0)


def _row(M: sp.Matrix, i: int) -> sp.Matrix:
    return M[i, :].T


def token_outputs(S, Q, K, Kt, V, beta, alpha=None, kda=False) -> sp.Matrix:
    """Read-outs ``o_i`` (rows) of the token recurrence; ``alpha``: scalar decays, or rows of channel
    decays for ``kda``."""
    rows = []
    for i in range(K.rows):
        if kda:
            S = sp.diag(*alpha[i, :]) * S
            S = S + beta[i] * _row(Kt, i) * (_row(V, i) - S.T * _row(K, i)).T
            rows.append((S.T * _row(Q, i)).T)
        else:
            if alpha is not None:
                S = alpha[i] * S
            S = S + beta[i] * (_row(V, i) - S * _row(K, i)) * _row(Kt, i).T
            rows.append((S * _row(Q, i)).T)
    return sp.Matrix.vstack(*rows)


def plain_chunk_output(S, Q, K, Kt, V, beta, *, score_key=None) -> sp.Matrix:
    """Listing 1's output; ``score_key`` replaces ``K̃`` in the score (to show the check can fail)."""
    B = sp.diag(*beta)
    T = unit_lower_inverse(sp.eye(K.rows) + _strict_lower(B * K * Kt.T))
    W, U = T * B * K, T * B * V
    score = _lower(Q * (Kt if score_key is None else score_key).T)
    return Q * S.T + score * (U - W * S.T)


def gated_chunk_output(S, Q, K, Kt, V, beta, alpha) -> sp.Matrix:
    """Listing 2's output with the decay-ratio gauge."""
    C = K.rows
    gamma = [sp.Mul(*alpha[: i + 1]) for i in range(C)]
    G, G_inv = sp.diag(*gamma), sp.diag(*[1 / g for g in gamma])
    B = sp.diag(*beta)
    M = unit_lower_inverse(sp.eye(C) + _strict_lower(B * (G * K) * (G_inv * Kt).T)) * B
    W, U = M * (G * K), M * V
    return (G * Q) * S.T + _lower((G * Q) * (G_inv * Kt).T) * (U - W * S.T)


def kda_chunk_output(S, Q, K, Kt, V, beta, A) -> sp.Matrix:
    """App. B.2's output with cumulative channel decays ``Γ``."""
    C, dk = K.shape
    Gam = sp.Matrix(C, dk, lambda i, j: sp.Mul(*[A[l, j] for l in range(i + 1)]))
    GK, GQ = Gam.multiply_elementwise(K), Gam.multiply_elementwise(Q)
    Kt_over = sp.Matrix(C, dk, lambda i, j: Kt[i, j] / Gam[i, j])
    B = sp.diag(*beta)
    M = unit_lower_inverse(sp.eye(C) + _strict_lower(B * GK * Kt_over.T)) * B
    W, U = M * GK, M * V
    return GQ * S + _lower(GQ * Kt_over.T) * (U - W * S)


def _symbols(C: int, dk: int, dv: int, kda: bool = False):
    S = matrix("S", dk, dv) if kda else matrix("S", dv, dk)
    return (S, matrix("q", C, dk), matrix("k", C, dk), matrix("kt", C, dk), matrix("v", C, dv),
            sp.symbols(f"beta_1:{C + 1}"))


def plain_steps(C: int, K: int, V: int) -> dict[str, bool]:
    S, Q, Kk, Kt, Vv, beta = _symbols(C, K, V)
    tokens = token_outputs(S, Q, Kk, Kt, Vv, beta)
    return {
        "Listing 1 output = token read-outs": all_vanish(plain_chunk_output(S, Q, Kk, Kt, Vv, beta) - tokens),
        "the symmetric score Q Kᵀ is not": not all_vanish(
            plain_chunk_output(S, Q, Kk, Kt, Vv, beta, score_key=Kk) - tokens
        ),
    }


def gated_steps(C: int, K: int, V: int) -> dict[str, bool]:
    S, Q, Kk, Kt, Vv, beta = _symbols(C, K, V)
    alpha = sp.symbols(f"alpha_1:{C + 1}", positive=True)
    diff = gated_chunk_output(S, Q, Kk, Kt, Vv, beta, alpha) - token_outputs(S, Q, Kk, Kt, Vv, beta, alpha)
    return {"Listing 2 output = gated token read-outs": all_vanish(diff)}


def kda_steps(C: int, K: int, V: int) -> dict[str, bool]:
    S, Q, Kk, Kt, Vv, beta = _symbols(C, K, V, kda=True)
    A = matrix("alpha", C, K, positive=True)
    diff = kda_chunk_output(S, Q, Kk, Kt, Vv, beta, A) - token_outputs(S, Q, Kk, Kt, Vv, beta, A, kda=True)
    return {"App. B.2 output = KDA token read-outs": all_vanish(diff)}


def _numbers(sizes: dict, kind: str) -> tuple[dict, str]:
    extra, sentence = supporting(kind)
    return {"C_checked": format_values(sizes["C"]), **extra}, sentence


def check_plain() -> Outcome:
    proof = derive("Listing 1 output vs token read-outs", plain_steps, **GRID)
    numbers, text = _numbers(proof.sizes, "plain")
    return conclude(
        f"For {format_sizes(proof.sizes)} (every entry symbolic, write keys independent of read keys) Q Sᵀ + "
        "tril(Q K̃ᵀ)(U − W Sᵀ) — the intra-chunk score with the diagonal kept — equals the read-outs "
        "o_i = S_i q_i of the token recurrence; with the symmetric score Q Kᵀ it does not." + text,
        [proof],
        numbers=numbers,
    )


def check_gated() -> Outcome:
    proof = derive("Listing 2 output vs gated token read-outs", gated_steps, **GRID)
    numbers, text = _numbers(proof.sizes, "gated")
    return conclude(
        f"For {format_sizes(proof.sizes)} (positive symbolic decays) (γ⊙Q)Sᵀ + tril((γ⊙Q)(K̃/γ)ᵀ)(U − W Sᵀ) "
        "equals the read-outs of the gated token recurrence S_i = α_i S_{i−1} + β_i(v_i − α_i S_{i−1}k_i)k̃_iᵀ."
        + text,
        [proof],
        numbers=numbers,
    )


def check_kda() -> Outcome:
    proof = derive("App. B.2 output vs KDA token read-outs", kda_steps, **GRID)
    numbers, text = _numbers(proof.sizes, "kda")
    return conclude(
        f"For {format_sizes(proof.sizes)} (K = d_k, V = d_v; positive symbolic channel decays) "
        "(Γ⊙Q)S + Tril((Γ⊙Q)(K̃/Γ)ᵀ)(U − W S) equals the read-outs o_i = S_iᵀ q_i of KDA's token recurrence "
        "with write key k̃." + text,
        [proof],
        numbers=numbers,
    )


CLAIMS = [
    Claim(
        id="chunk-output-listing-1",
        location="Sec. 4.3 Eq. (6) (Q K̃ᵀ score); App. A.2; App. C Listing 1 (lines 76–82)",
        quote="the intra-chunk output score uses the same write-side substitution",
        statement="The chunk output Q Sᵀ + tril(Q K̃ᵀ)(U − W Sᵀ) — intra-chunk score with the write-side "
        "key — equals the token recurrence's read-outs o_t = S_t q_t.",
        method=f"sympy, {format_sizes(GRID)}: chunk output minus token read-outs expands to 0 entrywise; the "
        "symmetric score Q Kᵀ fails; supporting fp64 sweep (numpy) up to the paper's chunk size 64.",
        expected="verified",
        check=check_plain,
    ),
    Claim(
        id="chunk-output-listing-2",
        location="App. C, Listing 2 (OSGDN chunk update, output line 39)",
        quote="the state and output kernels are the usual Gated DeltaNet kernels with K K ~ ⊤ and Q K ~ ⊤"
        " replacing the symmetric key products.",
        statement="The gated chunk output (γ⊙Q)Sᵀ + tril((γ⊙Q)(K̃/γ)ᵀ)(U − W Sᵀ) equals the gated token "
        "recurrence's read-outs.",
        method=f"sympy, {format_sizes(GRID)}: denominators cleared, difference expands to 0; supporting fp64 "
        "sweep up to chunk size 64.",
        expected="verified",
        check=check_gated,
    ),
    Claim(
        id="chunk-output-app-b2",
        location="App. B.2, OSKDA intra-chunk output O_[t]; App. C Listing 3",
        quote="The intra-chunk output formula uses the same storage-side replacement",
        statement="The OSKDA chunk output (Γ⊙Q)S + Tril((Γ⊙Q)(K̃/Γ)ᵀ)(U − W S) equals KDA's token read-outs "
        "o_t = S_tᵀ q_t with write key k̃.",
        method=f"sympy, {format_sizes(GRID)}: denominators cleared, difference expands to 0; supporting fp64 "
        "sweep up to chunk size 64.",
        expected="verified",
        check=check_kda,
    ),
]
