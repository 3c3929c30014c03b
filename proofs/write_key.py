"""Eq. (2)/(5) (Sec. 4.1, 4.3): the write-key equivalence; Sec. 4.5: the backward factorisation.

Notation: state ``S ∈ R^{V×K}``, key ``k``, value ``v``, gate ``β``, preconditioner ``d``, ``D = diag(d)``,
residual ``u = v − S k``, token loss ``f(S) = ½‖S k − v‖²``, write key ``k̃ = d ⊙ k``.

(a) Eq. (2): ``S − β ∇f(S) D = S + β u (d ⊙ k)ᵀ = S + β u k̃ᵀ`` with ``∇f(S)`` obtained by
    differentiating ``f`` entrywise (not assumed to be ``−u kᵀ``); ``kᵀ D = (d ⊙ k)ᵀ``; and Eq. (5):
    the same write is ``S (I − β k k̃ᵀ) + β v k̃ᵀ``. The read ``S k`` and the residual still use ``k``.
    Checked for K = 1..3, V = 1..2 with every entry symbolic, and in the free noncommutative algebra
    (``∇f = −u kᵀ``, ``u = v − S k``; any K, V).
(b) Sec. 4.5: ``k̃ = d ⊙ k`` has Jacobians ``∂k̃/∂d = diag(k)`` and ``∂k̃/∂k = diag(d)`` (diagonal, so equal
    to their transposes); by the chain rule, for any loss ``ℒ(k̃, k)``,
    ``∂ℒ/∂d = k ⊙ ∂ℒ/∂k̃`` and ``∂ℒ/∂k = ∂ℒ/∂k|_direct + d ⊙ ∂ℒ/∂k̃``. Checked for K = 1..3 on a generic
    polynomial of degree 2 in ``(k̃, k)`` (every monomial with its own symbolic coefficient) and, for
    the ``d`` part, on an undefined sympy function ``ℒ``. The factorisation treats ``d_t`` as
    independent of ``k_t`` — true for Algorithm 1, which emits ``d_t ⊙ k_t`` before ``d`` sees ``k_t``
    (see ``fig1-vs-algorithm-1``).
"""

from __future__ import annotations

import itertools

import sympy as sp

from ._claims import Claim, Outcome, conclude
from ._evidence import Derivation, derive, format_sizes, format_values
from ._sym import all_vanish, matrix, vanishes, vector

__all__ = ["BACKWARD_GRID", "CLAIMS", "GRID", "backward_steps", "noncommutative_steps", "write_steps"]

#: sizes of the write-key identities
GRID = {"K": (1, 2, 3), "V": (1, 2)}
#: key sizes of the backward factorisation
BACKWARD_GRID = {"K": (1, 2, 3)}


def write_steps(K: int, V: int) -> dict[str, bool]:
    """Eq. (2) and Eq. (5) for one write with every entry symbolic."""
    S, v, k = matrix("S", V, K, real=True), vector("v", V, real=True), vector("k", K, real=True)
    d, beta = vector("d", K, real=True), sp.Symbol("beta", real=True)
    r = S * k - v
    f = (r.T * r)[0] / 2
    grad = sp.Matrix(V, K, lambda a, b: sp.diff(f, S[a, b]))
    u = v - S * k
    kt = d.multiply_elementwise(k)
    preconditioned = S - beta * grad * sp.diag(*d)
    return {
        "∇f(S) = −u kᵀ": all_vanish(grad + u * k.T),
        "kᵀ diag(d) = (d ⊙ k)ᵀ": all_vanish(k.T * sp.diag(*d), kt.T),
        "S − β∇f(S)D = S + β u (d ⊙ k)ᵀ": all_vanish(preconditioned, S + beta * u * kt.T),
        "Eq. (5): = S(I − β k k̃ᵀ) + β v k̃ᵀ": all_vanish(
            preconditioned, S * (sp.eye(K) - beta * k * kt.T) + beta * v * kt.T
        ),
    }


def noncommutative_steps() -> dict[str, bool]:
    """Eq. (2) and (5) in the free noncommutative algebra of ``S, v, k, kᵀ, D`` (any K, V)."""
    S, v, k, kT, D = sp.symbols("S v k k^T D", commutative=False)
    beta = sp.Symbol("beta", real=True)
    u = v - S * k
    kt_T = kT * D  # (d ⊙ k)ᵀ = kᵀ D for diagonal D
    step = S - beta * (-u * kT) * D
    return {
        "S − β(−u kᵀ)D = S + β u (kᵀD)": vanishes(step, S + beta * u * kt_T),
        "= S(I − β k k̃ᵀ) + β v k̃ᵀ": vanishes(step, S * (1 - beta * k * kt_T) + beta * v * kt_T),
    }


def backward_steps(K: int) -> dict[str, bool]:
    """Sec. 4.5's factorisation for one K: Jacobians of ``k̃ = d ⊙ k`` and the chain rule."""
    d, k = vector("d", K, real=True), vector("k", K, real=True)
    x = vector("x", K, real=True)  # stands for k̃ inside ℒ
    kt = d.multiply_elementwise(k)
    at = dict(zip(x, kt))
    # a generic polynomial of degree 2 in (k̃, k): every monomial with its own coefficient
    variables = list(x) + list(k)
    monomials = [sp.Integer(1), *variables, *(a * b for a, b in itertools.combinations_with_replacement(variables, 2))]
    coefficients = sp.symbols(f"c0:{len(monomials)}", real=True)
    loss = sum((c * m for c, m in zip(coefficients, monomials)), sp.Integer(0))
    total = loss.subs(at, simultaneous=True)
    L = sp.Function("L")
    generic = L(*kt, *k)
    steps = {
        "∂k̃/∂d = diag(k)": all_vanish(kt.jacobian(d), sp.diag(*k)),
        "∂k̃/∂k = diag(d)": all_vanish(kt.jacobian(k), sp.diag(*d)),
    }
    for i in range(K):
        dL_dkt = sp.diff(loss, x[i]).subs(at, simultaneous=True)
        direct = sp.diff(loss, k[i]).subs(at, simultaneous=True)
        steps[f"polynomial ℒ: ∂ℒ/∂d_{i + 1} = k_{i + 1} ∂ℒ/∂k̃_{i + 1}"] = vanishes(
            sp.diff(total, d[i]), k[i] * dL_dkt
        )
        steps[f"polynomial ℒ: ∂ℒ/∂k_{i + 1} = direct + d_{i + 1} ∂ℒ/∂k̃_{i + 1}"] = vanishes(
            sp.diff(total, k[i]) - direct, d[i] * dL_dkt
        )
        partial = sp.diff(L(*x, *k), x[i]).subs(at, simultaneous=True)
        steps[f"any ℒ: ∂ℒ/∂d_{i + 1} = k_{i + 1} ∂ℒ/∂k̃_{i + 1}"] = vanishes(sp.diff(generic, d[i]), k[i] * partial)
    return steps


def check_write_key() -> Outcome:
    explicit = derive("explicit symbols", write_steps, **GRID)
    free = Derivation("free noncommutative algebra (any K, V)", noncommutative_steps())
    return conclude(
        "Differentiating f gives ∇f(S) = −u kᵀ; then S − β∇f(S)diag(d) = S + βu(d ⊙ k)ᵀ and, with "
        "u = v − Sk, = S(I − βk k̃ᵀ) + βv k̃ᵀ (Eq. 5): the preconditioner moves only to the write-side key, "
        f"while the read Sk and the residual keep k ({format_sizes(explicit.sizes)}, every entry symbolic; "
        "also in the free noncommutative algebra for any K, V).",
        [explicit, free],
        numbers={"K_checked": format_values(explicit.sizes["K"])},
    )


def check_backward() -> Outcome:
    proof = derive("chain rule through k̃ = d ⊙ k", backward_steps, **BACKWARD_GRID)
    return conclude(
        "∂k̃/∂d = diag(k) and ∂k̃/∂k = diag(d), so for any loss ℒ(k̃, k): ∂ℒ/∂d = k ⊙ ∂ℒ/∂k̃ and "
        "∂ℒ/∂k = ∂ℒ/∂k|direct + d ⊙ ∂ℒ/∂k̃ (a generic degree-2 polynomial, and an undefined function for the d "
        f"part; {format_sizes(proof.sizes)}). This is the local factorisation at one token with d_t "
        "independent of k_t, as Algorithm 1 orders it; the recurrence's reverse sweep then carries ∂ℒ/∂d_t "
        "into earlier keys and gates.",
        [proof],
        numbers={"K_checked": format_values(proof.sizes["K"])},
    )


CLAIMS = [
    Claim(
        id="eq-2-write-key-equivalence",
        location="Sec. 4.1, Eq. (2); Sec. 4.3, Eq. (5); contribution 'exact write-key scaling equivalence'",
        quote="where the second equality uses k t ⊤ D t = ( d t ⊙ k t ) ⊤ to turn the diagonal "
        "preconditioner into a per-feature scaling of the write-side key.",
        statement="Right-preconditioning the token gradient equals scaling the write key: S − β∇f_t(S)D_t = "
        "S + βu_t(d_t ⊙ k_t)ᵀ = S(I − βk_t k̃_tᵀ) + βv_t k̃_tᵀ, with the read and the residual unchanged.",
        method=f"sympy, {format_sizes(GRID)}: ∇f by entrywise differentiation; the three forms subtracted "
        "entrywise expand to 0; free noncommutative algebra for any K, V.",
        expected="verified",
        check=check_write_key,
    ),
    Claim(
        id="sec-4.5-backward-factorisation",
        location="Sec. 4.5 ('The backward pass factors cleanly')",
        quote="The backward pass factors cleanly: phase 2 produces ∂ ℒ / ∂ k ~ t , from which ∂ ℒ / ∂ d t"
        " = k t ⊙ ∂ ℒ / ∂ k ~ t and ∂ ℒ / ∂ k t + = d t ⊙ ∂ ℒ / ∂ k ~ t",
        statement="Phase 2's ∂ℒ/∂k̃_t gives ∂ℒ/∂d_t = k_t ⊙ ∂ℒ/∂k̃_t and ∂ℒ/∂k_t += d_t ⊙ ∂ℒ/∂k̃_t.",
        method=f"sympy, {format_sizes(BACKWARD_GRID)}: Jacobians of k̃ = d ⊙ k; chain rule on a generic "
        "degree-2 polynomial ℒ(k̃, k) with symbolic coefficients and on an undefined function ℒ.",
        expected="verified",
        check=check_backward,
    ),
]
