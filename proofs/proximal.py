"""App. A.5, 'Interpretation': the APF step as a proximal (linearised) step, and the implicit step.

Notation: key ``k``, ``s = k ⊙ k``, ``n = ‖k‖²``, ``n̄ = max(n, ε)``, gate ``β``, step ``η > 0``, retention
``r`` (a K-vector; a scalar is the case of equal entries), current ``d``; surrogate
``h(D) = ((1 − β⟨D, s⟩)² − 1)/(2n)`` with gradient ``∇h(d) = −β(1 − β⟨d, s⟩)/n · s`` (Lemma 4.1).

Proved for K = 1..3 with every entry symbolic (``s`` a free nonnegative vector and ``n`` a free positive
scalar, so the identities hold in particular for ``s = k ⊙ k``, ``n = ‖k‖²``):
``Φ(D) = ⟨∇h(d), D⟩ + ‖D − r ⊙ d‖²/(2η)`` satisfies
``Φ(D) − Φ(D̂) = ‖D − D̂‖²/(2η) ≥ 0`` at ``D̂ = r ⊙ d − η∇h(d)`` — so ``D̂`` is the unique minimiser — and
``D̂`` is Eq. (7)'s unprojected step with ``n̄ = n``. The implicit step ``argmin h(D) + ‖D − r ⊙ d‖²/(2η)``
solves ``(I + ηβ²/n · s sᵀ)D = r ⊙ d + ηβ/n · s``, and the Sherman–Morrison formula
``D = (I − c s sᵀ/(1 + c‖s‖²))(r ⊙ d + ηβ/n · s)``, ``c = ηβ²/n``, solves it. The equivalence needs
``‖k‖² ≥ ε``: below the floor Eq. (7) divides by ``ε`` while ``∇h`` divides by ``‖k‖²``.
"""

from __future__ import annotations

import sympy as sp

from ._claims import Claim, Outcome, conclude
from ._evidence import Conditional, Counterexample, derive, format_sizes
from ._sym import all_vanish, dot, is_nonnegative, vanishes, vector
from .lemma_4_1 import surrogate_closed_form, surrogate_gradient_closed_form
from .lemma_d6 import apf_step

__all__ = ["CLAIMS", "GRID", "proximal_steps"]

#: key sizes checked with explicit symbols
GRID = {"K": (1, 2, 3)}
#: Listing 1's floor on the squared key norm
EPSILON = sp.Rational(1, 10**6)


def proximal_steps(K: int) -> dict[str, bool]:
    """The proximal and implicit forms of the APF step for one K (with ``n̄ = n``)."""
    # s and n enter only as a vector and a positive scalar: the identities hold for any of them,
    # in particular for s = k ⊙ k and n = ‖k‖²
    d, r, D = (vector(name, K, real=True) for name in ("d", "r", "D"))
    s, n = vector("s", K, nonnegative=True), sp.Symbol("n", positive=True)
    beta, eta = sp.Symbol("beta", real=True), sp.Symbol("eta", positive=True)
    grad = surrogate_gradient_closed_form(beta, beta * dot(d, s), n, s)
    centre = r.multiply_elementwise(d)
    phi = lambda X: dot(grad, X) + dot(X - centre, X - centre) / (2 * eta)  # noqa: E731
    best = centre - eta * grad
    gap = dot(D - best, D - best) / (2 * eta)
    # implicit step: stationarity of h(D) + ‖D − r ⊙ d‖²/(2η), multiplied by η
    psi_grad = sp.Matrix([sp.diff(surrogate_closed_form(beta * dot(D, s), n), x) for x in D]) + (D - centre) / eta
    system, rhs = sp.eye(K) + eta * beta**2 / n * s * s.T, centre + eta * beta / n * s
    c = eta * beta**2 / n
    sherman_morrison = (sp.eye(K) - c * s * s.T / (1 + c * dot(s, s))) * rhs
    return {
        "Φ(D) − Φ(D̂) = ‖D − D̂‖²/(2η)": vanishes(phi(D) - phi(best), gap),
        "‖D − D̂‖²/(2η) ≥ 0": is_nonnegative(gap.subs(dict(zip(D - best, vector("w", K, real=True))))),
        "D̂ = Eq. (7) with n̄ = n": all_vanish(best, apf_step(d, s, n, beta, eta, r)),
        "implicit: η∇Ψ(D) = (I + ηβ²/n ssᵀ)D − (r ⊙ d + ηβ/n s)": all_vanish(eta * psi_grad, system * D - rhs),
        "implicit: Sherman–Morrison solves it": all_vanish(system * sherman_morrison, rhs),
    }


def _below_floor() -> Counterexample:
    """K = 1, ‖k‖² = 1/4 000 000 < ε: Eq. (7)'s step against r ⊙ d − η∇h(d)."""
    k, d, r, beta, eta = sp.Rational(1, 2000), sp.Integer(1), sp.Integer(1), sp.Rational(1, 2), sp.Rational(3, 1000)
    s = n = k**2
    n_bar = max(n, EPSILON)
    apf = apf_step(sp.Matrix([d]), sp.Matrix([s]), n_bar, beta, eta, r)[0]
    proximal = r * d - eta * surrogate_gradient_closed_form(beta, beta * d * s, n, sp.Matrix([s]))[0]
    return Counterexample(
        "‖k‖² below the floor ε",
        apf,
        "=",
        proximal,
        instance={"k": k, "epsilon": EPSILON, "beta": beta, "eta": eta, "r": r, "d": d},
        sizes={"K": 1},
        steps={"‖k‖² < ε": n < EPSILON},
    )


def check_proximal() -> Outcome:
    under = derive("proximal and implicit forms", proximal_steps, **GRID)
    without = _below_floor()
    condition = Conditional("‖k_t‖² ≥ ε, so that max(‖k_t‖², ε) = ‖k_t‖²", (under,), (without,))
    return conclude(
        "D̂ = r ⊙ d − η∇h(d) minimises ⟨∇h(d), D⟩ + ‖D − r ⊙ d‖²/(2η) uniquely (the difference to the minimum "
        "is ‖D − D̂‖²/(2η)) and equals Eq. (7)'s unprojected step when max(‖k‖², ε) = ‖k‖²; the implicit step "
        "solves (I + ηβ²/n ssᵀ)D = r ⊙ d + ηβ/n s, which Sherman–Morrison inverts "
        f"({format_sizes(under.sizes)}). Below the floor the two differ: k = 1/2000, ε = 1e-6 gives an APF step "
        f"of {float(without.lhs):.6g} against {float(without.rhs):.6g}.",
        [condition],
    )


CLAIMS = [
    Claim(
        id="app-a5-apf-proximal-form",
        location="App. A.5, 'Interpretation' after Prop. A.3",
        quote="The unprojected APF step can be read as a gradient step on the linearisation of h t around"
        " d t with proximal centre shifted from d t to 𝒓 t ⊙ d t .",
        statement="The unprojected APF step is d̄_{t+1} = argmin_D {⟨∇h_t(d_t), D⟩ + ‖D − r_t ⊙ d_t‖²/(2η)}; "
        "the implicit step on h_t would solve a rank-one Sherman–Morrison system.",
        method=f"sympy, {format_sizes(GRID)}: Φ(D) − Φ(D̂) = ‖D − D̂‖²/(2η); D̂ against Eq. (7) with n̄ = n; the "
        "implicit stationarity system and its Sherman–Morrison solution; an exact key below the floor ε.",
        expected="conditional",
        check=check_proximal,
    ),
]
