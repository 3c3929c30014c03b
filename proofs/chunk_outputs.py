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
from ._evidence import Conditional, Counterexample, Derivation, derive, format_sizes, format_values
from ._sweep import clamp_drift, supporting
from ._sym import all_vanish, indexed, is_nonzero, matrix, relation, vanishes
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
#: Listings 2–3 divide the write key by ``gamma.clamp_min(1e-6)``
LISTING_CLAMP = sp.Rational(1, 10**6)


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


def _floor(g, clamp):
    """``g.clamp_min(clamp)`` of Listings 2–3 (``clamp=None``: the unclamped formula)."""
    return g if clamp is None else sp.Max(g, clamp)


def gated_chunk_output(S, Q, K, Kt, V, beta, alpha, clamp=None) -> sp.Matrix:
    """Listing 2's output with the decay-ratio gauge; ``clamp``: the floor the listing puts under the
    cumulative decay it divides the write key by (:data:`LISTING_CLAMP` as printed, None: none)."""
    C = K.rows
    gamma = [sp.Mul(*alpha[: i + 1]) for i in range(C)]
    G, G_inv = sp.diag(*gamma), sp.diag(*[1 / _floor(g, clamp) for g in gamma])
    B = sp.diag(*beta)
    M = unit_lower_inverse(sp.eye(C) + _strict_lower(B * (G * K) * (G_inv * Kt).T)) * B
    W, U = M * (G * K), M * V
    return (G * Q) * S.T + _lower((G * Q) * (G_inv * Kt).T) * (U - W * S.T)


def kda_chunk_output(S, Q, K, Kt, V, beta, A, clamp=None) -> sp.Matrix:
    """App. B.2's output with cumulative channel decays ``Γ`` (Listing 3 with ``clamp``, as in
    :func:`gated_chunk_output`)."""
    C, dk = K.shape
    Gam = sp.Matrix(C, dk, lambda i, j: sp.Mul(*[A[l, j] for l in range(i + 1)]))
    GK, GQ = Gam.multiply_elementwise(K), Gam.multiply_elementwise(Q)
    Kt_over = sp.Matrix(C, dk, lambda i, j: Kt[i, j] / _floor(Gam[i, j], clamp))
    B = sp.diag(*beta)
    M = unit_lower_inverse(sp.eye(C) + _strict_lower(B * GK * Kt_over.T)) * B
    W, U = M * GK, M * V
    return GQ * S + _lower(GQ * Kt_over.T) * (U - W * S)


def _symbols(C: int, dk: int, dv: int, kda: bool = False):
    S = matrix("S", dk, dv) if kda else matrix("S", dv, dk)
    return (S, matrix("q", C, dk), matrix("k", C, dk), matrix("kt", C, dk), matrix("v", C, dv),
            indexed("beta", C))


def plain_steps(C: int, K: int, V: int) -> dict[str, bool]:
    S, Q, Kk, Kt, Vv, beta = _symbols(C, K, V)
    tokens = token_outputs(S, Q, Kk, Kt, Vv, beta)
    return {
        "Listing 1 output = token read-outs": all_vanish(plain_chunk_output(S, Q, Kk, Kt, Vv, beta), tokens),
        "the symmetric score Q Kᵀ is not": is_nonzero(
            plain_chunk_output(S, Q, Kk, Kt, Vv, beta, score_key=Kk) - tokens
        ),
    }


def _unclamp(expr, clamp):
    """Every ``max(γ, clamp)`` of ``expr`` replaced by ``γ``: licensed where every cumulative decay is
    ``≥ clamp`` (:func:`clamp_inactive_steps`)."""
    return expr.replace(lambda e: isinstance(e, sp.Max) and clamp in e.args,
                        lambda e: [a for a in e.args if a != clamp][0])


def clamp_inactive_steps(clamp=LISTING_CLAMP) -> dict[str, bool]:
    """``γ ≥ clamp ⇒ max(γ, clamp) = γ``, with ``γ = clamp + s``, ``s ≥ 0``."""
    s_ = sp.Symbol("s", nonnegative=True)
    return {"γ ≥ 10⁻⁶ ⇒ γ.clamp_min(10⁻⁶) = γ": vanishes(sp.Max(clamp + s_, clamp, evaluate=False), clamp + s_)}


def gated_steps(C: int, K: int, V: int) -> dict[str, bool]:
    S, Q, Kk, Kt, Vv, beta = _symbols(C, K, V)
    alpha = indexed("alpha", C, positive=True)
    printed = gated_chunk_output(S, Q, Kk, Kt, Vv, beta, alpha, clamp=LISTING_CLAMP)
    diff = _unclamp(printed, LISTING_CLAMP) - token_outputs(S, Q, Kk, Kt, Vv, beta, alpha)
    return {
        "Listing 2 as printed has a clamp on every γ_i": relation(sum(1 for _ in printed.atoms(sp.Max)), "=", C),
        "Listing 2 output, γ_i ≥ 10⁻⁶, = gated token read-outs": all_vanish(diff),
    }


def kda_steps(C: int, K: int, V: int) -> dict[str, bool]:
    S, Q, Kk, Kt, Vv, beta = _symbols(C, K, V, kda=True)
    A = matrix("alpha", C, K, positive=True)
    printed = kda_chunk_output(S, Q, Kk, Kt, Vv, beta, A, clamp=LISTING_CLAMP)
    diff = _unclamp(printed, LISTING_CLAMP) - token_outputs(S, Q, Kk, Kt, Vv, beta, A, kda=True)
    return {
        "Listing 3 as printed has a clamp on every Γ_ij": relation(
            sum(1 for _ in printed.atoms(sp.Max)), "=", C * K
        ),
        "App. B.2 / Listing 3 output, Γ_ij ≥ 10⁻⁶, = KDA token read-outs": all_vanish(diff),
    }


def clamp_counterexample(kind: str) -> Counterexample:
    """One chunk of two tokens (K = V = 1, S = 0, q = k = k̃ = v = 1, β = 1/2) whose second decay
    ``α_2 = 10⁻⁷`` takes the cumulative decay below the clamp: the printed listing reads token 2's own
    write scaled by ``γ_2/10⁻⁶ = 1/10``, the token recurrence reads it whole."""
    one = sp.Matrix([[1], [1]])
    S = sp.zeros(1, 1)
    beta, alpha = (sp.Rational(1, 2),) * 2, (sp.Integer(1), sp.Rational(1, 10**7))
    if kind == "kda":
        A = sp.Matrix([[alpha[0]], [alpha[1]]])
        chunk = kda_chunk_output(S, one, one, one, one, beta, A, clamp=LISTING_CLAMP)
        tokens = token_outputs(S, one, one, one, one, beta, A, kda=True)
    else:
        chunk = gated_chunk_output(S, one, one, one, one, beta, alpha, clamp=LISTING_CLAMP)
        tokens = token_outputs(S, one, one, one, one, beta, alpha)
    return Counterexample(
        f"Listing {3 if kind == 'kda' else 2} as printed, cumulative decay 10⁻⁷ < 10⁻⁶",
        chunk[1, 0],
        "=",
        tokens[1, 0],  # claimed: the chunk output is the token read-out
        instance={"q = k = k̃ = v": 1, "S": 0, "beta": beta, "alpha": alpha, "gamma_2": alpha[0] * alpha[1],
                  "clamp": LISTING_CLAMP},
        sizes={"C": 2, "K": 1, "V": 1},
        steps={"γ_2 < 10⁻⁶": alpha[0] * alpha[1] < LISTING_CLAMP},
    )


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


_CONDITION = "every cumulative decay of the chunk ≥ 10⁻⁶ (the listing's clamp_min(1e-6) inactive)"


def _clamp_text(kind: str) -> tuple[dict, str]:
    """The fp64 drift of the printed listing at the paper's chunk size (supporting numbers)."""
    drift = clamp_drift(kind)
    shown = ", ".join(f"{e:.1%} at α = {a}" for a, e in drift["median_rel_output_err"].items())
    return {"listing_clamp_fp64": drift}, (
        f" As printed, the clamp stops the listing matching the recurrence once a cumulative decay falls below "
        f"10⁻⁶: over one chunk of {drift['C']} tokens with a constant decay (fp64, median over {drift['seeds']} "
        f"random chunks, relative Frobenius error of the outputs) {shown}."
    )


def check_gated() -> Outcome:
    proof = derive("Listing 2 output (as printed, clamp inactive) vs gated token read-outs", gated_steps, **GRID)
    inactive = Derivation("the clamp is inactive above 10⁻⁶", clamp_inactive_steps())
    without = clamp_counterexample("gated")
    numbers, text = _numbers(proof.sizes, "gated")
    extra, clamp_text = _clamp_text("gated")
    return conclude(
        f"For {format_sizes(proof.sizes)} (positive symbolic decays) Listing 2 as printed, "
        "(γ⊙Q)Sᵀ + tril((γ⊙Q)(K̃/γ.clamp_min(10⁻⁶))ᵀ)(U − W Sᵀ), equals the read-outs of the gated token "
        "recurrence S_i = α_i S_{i−1} + β_i(v_i − α_i S_{i−1}k_i)k̃_iᵀ wherever every γ_i ≥ 10⁻⁶. Below it the "
        f"listing divides by 10⁻⁶ instead of γ_i: with γ_2 = 10⁻⁷ token 2 reads {without.lhs}, the recurrence "
        f"{without.rhs}." + clamp_text + text,
        [Conditional(_CONDITION, (proof, inactive), (without,))],
        numbers={**numbers, **extra},
    )


def check_kda() -> Outcome:
    proof = derive("Listing 3 output (as printed, clamp inactive) vs KDA token read-outs", kda_steps, **GRID)
    inactive = Derivation("the clamp is inactive above 10⁻⁶", clamp_inactive_steps())
    without = clamp_counterexample("kda")
    numbers, text = _numbers(proof.sizes, "kda")
    extra, clamp_text = _clamp_text("kda")
    return conclude(
        f"For {format_sizes(proof.sizes)} (K = d_k, V = d_v; positive symbolic channel decays) the output as "
        "Listing 3 prints it, (Γ⊙Q)S + Tril((Γ⊙Q)(K̃/Γ.clamp_min(10⁻⁶))ᵀ)(U − W S), equals the read-outs "
        "o_i = S_iᵀ q_i of KDA's token recurrence with write key k̃ wherever every Γ_ij ≥ 10⁻⁶; with a "
        f"cumulative decay of 10⁻⁷ token 2 reads {without.lhs}, the recurrence {without.rhs}." + clamp_text + text,
        [Conditional(_CONDITION, (proof, inactive), (without,))],
        numbers={**numbers, **extra},
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
        statement="Listing 2's chunk output as printed, (γ⊙Q)Sᵀ + tril((γ⊙Q)(K̃/γ.clamp_min(1e-6))ᵀ)(U − W Sᵀ), "
        "equals the gated token recurrence's read-outs.",
        method=f"sympy, {format_sizes(GRID)}: the printed clamp replaced by γ where γ ≥ 10⁻⁶, denominators "
        "cleared, difference expands to 0; an exact two-token chunk with γ_2 = 10⁻⁷; fp64 drift of the printed "
        "listing at chunk size 64; supporting fp64 sweep of the unclamped form up to chunk size 64.",
        expected="conditional",
        check=check_gated,
    ),
    Claim(
        id="chunk-output-app-b2",
        location="App. B.2, OSKDA intra-chunk output O_[t]; App. C Listing 3",
        quote="The intra-chunk output formula uses the same storage-side replacement",
        statement="The OSKDA chunk output as Listing 3 prints it, (Γ⊙Q)S + Tril((Γ⊙Q)(K̃/Γ.clamp_min(1e-6))ᵀ)"
        "(U − W S), equals KDA's token read-outs o_t = S_tᵀ q_t with write key k̃.",
        method=f"sympy, {format_sizes(GRID)}: the printed clamp replaced by Γ where Γ ≥ 10⁻⁶, denominators "
        "cleared, difference expands to 0; an exact two-token chunk with Γ_2 = 10⁻⁷; fp64 drift of the printed "
        "listing at chunk size 64; supporting fp64 sweep of the unclamped form up to chunk size 64.",
        expected="conditional",
        check=check_kda,
    ),
]
