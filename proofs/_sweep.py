"""Supporting fp64 sweeps of the chunkwise forms (numpy): chunk sizes beyond what sympy can expand.

These numbers are *supporting evidence*, reported in a claim's ``numbers`` and never among its
evidence: floats establish nothing in this ledger (:mod:`._evidence`). Each sweep runs one chunk of C
tokens with random data from a fixed seed — unit read keys, write keys ``d ⊙ k`` with ``d ∈ [0.5, 2]``,
gates ``β ∈ (0, 1)``, decays ``α ∈ [0.95, 1)`` — through the token recurrence and through the chunk
form of the paper (state and outputs), and records the largest relative difference.

Conventions as in :mod:`.wy_chunk` and :mod:`.chunk_outputs`: DeltaNet/GDN states are ``V × K`` and
read ``o_i = S_i q_i`` after the write of token ``i``; KDA states are ``K × V`` and read ``o_i = S_iᵀ q_i``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CHUNK_SIZES", "clamp_drift", "supporting", "sweep"]

#: chunk sizes of the sweeps (64 is the paper's chunk_size)
CHUNK_SIZES = (2, 4, 8, 16, 32, 64)
_K, _V = 16, 8


def _data(rng, C, kind):
    k = rng.normal(size=(C, _K))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    q = rng.normal(size=(C, _K))
    kt = rng.uniform(0.5, 2.0, size=(C, _K)) * k
    v = rng.normal(size=(C, _V))
    beta = rng.uniform(0.05, 0.95, size=C)
    alpha = rng.uniform(0.95, 1.0, size=(C, _K) if kind == "kda" else C)
    S = rng.normal(size=(_K, _V) if kind == "kda" else (_V, _K))
    return q, k, kt, v, beta, alpha, S


def _tokens(q, k, kt, v, beta, alpha, S, kind):
    outputs = []
    for i in range(len(k)):
        if kind == "plain":
            S = S + beta[i] * np.outer(v[i] - S @ k[i], kt[i])
            outputs.append(S @ q[i])
        elif kind == "gated":
            S = alpha[i] * S
            S = S + beta[i] * np.outer(v[i] - S @ k[i], kt[i])
            outputs.append(S @ q[i])
        else:  # kda: S ∈ R^{K×V}
            S = alpha[i][:, None] * S
            S = S + beta[i] * np.outer(kt[i], v[i] - S.T @ k[i])
            outputs.append(S.T @ q[i])
    return S, np.array(outputs)


def _unit_lower_solve(A, B):
    """``(I + A)⁻¹ B`` for strictly lower-triangular ``A``, by forward substitution."""
    X = np.zeros_like(B)
    for i in range(len(A)):
        X[i] = B[i] - A[i, :i] @ X[:i]
    return X


def _chunk(q, k, kt, v, beta, alpha, S, kind):
    C = len(k)
    strict, incl = np.tril(np.ones((C, C)), -1), np.tril(np.ones((C, C)))
    if kind == "plain":
        A = strict * (beta[:, None] * (k @ kt.T))
        W = _unit_lower_solve(A, beta[:, None] * k)
        U = _unit_lower_solve(A, beta[:, None] * v)
        update = U - W @ S.T
        out = q @ S.T + (incl * (q @ kt.T)) @ update
        return S + update.T @ kt, out
    if kind == "gated":
        g = np.cumprod(alpha)
        gk, gq, ktn = g[:, None] * k, g[:, None] * q, kt / g[:, None]
        A = strict * (beta[:, None] * (gk @ ktn.T))
        W = _unit_lower_solve(A, beta[:, None] * gk)
        U = _unit_lower_solve(A, beta[:, None] * v)
        update = U - W @ S.T
        out = gq @ S.T + (incl * (gq @ ktn.T)) @ update
        return g[-1] * S + update.T @ ((g[-1] / g)[:, None] * kt), out
    G = np.cumprod(alpha, axis=0)  # kda
    gk, gq, ktn = G * k, G * q, kt / G
    A = strict * (beta[:, None] * (gk @ ktn.T))
    W = _unit_lower_solve(A, beta[:, None] * gk)
    U = _unit_lower_solve(A, beta[:, None] * v)
    update = U - W @ S
    out = gq @ S + (incl * (gq @ ktn.T)) @ update
    return G[-1][:, None] * S + ((G[-1] / G) * kt).T @ update, out


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def sweep(kind: str, sizes=CHUNK_SIZES, seed: int = 0) -> dict:
    """Largest relative differences (state, output) between chunk and token forms over ``sizes``.

    ``kind``: ``"plain"`` (App. A.2 / Listing 1), ``"gated"`` (App. B.1 / Listing 2) or ``"kda"``
    (App. B.2 / Listing 3).
    """
    if kind not in ("plain", "gated", "kda"):
        raise ValueError(f"sweep: kind must be 'plain', 'gated' or 'kda', got {kind!r}")
    rng = np.random.default_rng(seed)
    state_err = output_err = 0.0
    for C in sizes:
        data = _data(rng, C, kind)
        S_tok, o_tok = _tokens(*data, kind)
        S_chk, o_chk = _chunk(*data, kind)
        state_err = max(state_err, _rel(S_chk, S_tok))
        output_err = max(output_err, _rel(o_chk, o_tok))
    return {
        "kind": "supporting fp64 sweep (not evidence)",
        "C": list(sizes),
        "K": _K,
        "V": _V,
        "max_rel_err_state": state_err,
        "max_rel_err_output": output_err,
    }


def supporting(kind: str) -> tuple[dict, str]:
    """``({"supporting_fp64_sweep": …}, sentence)``: the sweep for a claim's numbers and its detail."""
    z = sweep(kind)
    worst = max(z["max_rel_err_state"], z["max_rel_err_output"])
    sentence = (
        " Supporting, not evidence: an fp64 sweep over chunks of 2 to 64 tokens (key size "
        f"{z['K']}, value size {z['V']}) agrees with the token recurrence to {worst:.1e} relative "
        "(state and outputs)."
    )
    return {"supporting_fp64_sweep": z}, sentence


def _printed_chunk_outputs(q, k, kt, v, beta, alpha, S, kind, clamp=1e-6):
    """Listings 2–3 as printed: the write key divided by the cumulative decay floored at ``clamp``."""
    C = len(k)
    strict, incl = np.tril(np.ones((C, C)), -1), np.tril(np.ones((C, C)))
    g = np.cumprod(alpha, axis=0)
    if kind == "gated":
        gk, gq, ktn = g[:, None] * k, g[:, None] * q, kt / np.maximum(g, clamp)[:, None]
    else:
        gk, gq, ktn = g * k, g * q, kt / np.maximum(g, clamp)
    A = strict * (beta[:, None] * (gk @ ktn.T))
    W = _unit_lower_solve(A, beta[:, None] * gk)
    U = _unit_lower_solve(A, beta[:, None] * v)
    update = U - (W @ S.T if kind == "gated" else W @ S)
    return (gq @ S.T if kind == "gated" else gq @ S) + (incl * (gq @ ktn.T)) @ update


def clamp_drift(kind: str, alphas=(0.8, 0.75), C: int = 64, seeds: int = 20) -> dict:
    """Relative Frobenius error of the outputs of Listings 2–3 *as printed* (``clamp_min(1e-6)``) against
    the token recurrence, over one chunk of ``C`` tokens with a constant decay ``α`` (every channel for
    KDA): ``γ_i = α^i`` falls below 10⁻⁶ at ``i > log(10⁻⁶)/log α`` (62 at 0.8, 48 at 0.75). The median over
    ``seeds`` random chunks (the sweep's data, seeds 0, 1, …), per ``α``."""
    if kind not in ("gated", "kda"):
        raise ValueError(f"clamp_drift: kind must be 'gated' or 'kda', got {kind!r}")
    out = {}
    for a in alphas:
        errs = []
        for seed in range(seeds):
            q, k, kt, v, beta, alpha, S = _data(np.random.default_rng(seed), C, kind)
            alpha = np.full_like(alpha, a)
            _, tokens = _tokens(q, k, kt, v, beta, alpha, S, kind)
            printed = _printed_chunk_outputs(q, k, kt, v, beta, alpha, S, kind)
            errs.append(float(np.linalg.norm(printed - tokens) / np.linalg.norm(tokens)))
        out[str(a)] = float(np.median(errs))
    return {"kind": "supporting fp64 (not evidence)", "C": C, "seeds": seeds, "K": _K, "V": _V,
            "median_rel_output_err": out}
