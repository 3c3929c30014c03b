"""App. D.3, 'Diagonal comparator gap': the three-term regret decomposition and when the box gap vanishes.

Notation: population feedbacks ``h_t`` (Eq. 16) along the learner's states; learner ``D_t``; fixed
comparators ``D_box⋆`` (best in the box class), ``D_diag⋆`` (best diagonal), ``D⋆ = Σ_k†``.

Proved for T = 1..4 (symbolic values of every ``h_t`` at the four points):

* the decomposition ``Σ(h_t(D_t) − h_t(D⋆)) = Σ(h_t(D_t) − h_t(D_box⋆)) + Σ(h_t(D_box⋆) − h_t(D_diag⋆)) +
  Σ(h_t(D_diag⋆) − h_t(D⋆))`` is an identity;
* the box gap is ``≥ 0`` (``D_box⋆`` is a diagonal candidate, so ``Σh_t(D_box⋆) = Σh_t(D_diag⋆) + ξ`` with
  ``ξ ≥ 0`` by minimality of ``D_diag⋆``) and is 0 when ``D_diag⋆`` lies in the box (then also
  ``Σh_t(D_diag⋆) = Σh_t(D_box⋆) + ξ'`` with ``ξ' ≥ 0``, so ``ξ = −ξ'``, i.e. both 0);
* the diagonal gap is ``≥ 0`` term by term, since ``D⋆`` minimises every ``h_t`` (lemma-d3-newton-feedback).

The paper's example ("normalized keys with ``β_t⟨d_diag⋆, k_t²⟩ ≡ 1`` achievable inside the box") is a
statement about the token-local surrogate (18), not the population feedback (16) of this
decomposition, which has no ``β_t``. For (18) it holds: with unit keys ``h_t(d) + 1/2 = (1 − a_t)²/2 ≥ 0``
with equality at ``a_t = 1``, so such a ``d`` minimises every ``h_t`` over ``R^K``. An exact K = 1 token
with ``β = 1/4 < 1/d_max`` shows that the box gap can be positive.
"""

from __future__ import annotations

import sympy as sp

from ._claims import Claim, Outcome, conclude
from ._evidence import Derivation, Witness, derive, format_sizes
from ._sym import holds_on, is_nonnegative, vanishes

__all__ = ["CLAIMS", "TS", "decomposition_steps", "box_gap_example"]

#: numbers of tokens T checked
TS = (1, 2, 3, 4)


def decomposition_steps(T: int) -> dict[str, bool]:
    """The identity and the signs of the two gaps for T tokens (every ``h_t`` value a free symbol)."""
    learner, box, diag, star = (sp.symbols(f"{name}_1:{T + 1}", real=True) for name in ("hL", "hB", "hD", "hS"))
    total = lambda h: sum(h, sp.Integer(0))  # noqa: E731
    # minimality as slacks: D_box⋆ is a diagonal candidate, so Σh(D_box⋆) = Σh(D_diag⋆) + ξ with ξ ≥ 0;
    # D_diag⋆ in the box makes it a box candidate too: Σh(D_diag⋆) = Σh(D_box⋆) + ξ' with ξ' ≥ 0
    xi = sp.Symbol("xi", nonnegative=True)
    both = sp.Symbol("zeta", nonnegative=True, nonpositive=True)  # ξ when ξ ≥ 0 and ξ = −ξ' ≤ 0
    over = sp.symbols(f"o_1:{T + 1}", nonnegative=True)  # h_t(D_diag⋆) − h_t(D⋆) ≥ 0: D⋆ minimises h_t
    box_gap, diag_gap = total(box) - total(diag), total(diag) - total(star)
    return {
        "regret to D⋆ = OGD regret + box gap + diagonal gap": vanishes(
            (total(learner) - total(star)) - ((total(learner) - total(box)) + box_gap + diag_gap)
        ),
        "box gap = ξ ≥ 0": holds_on(box_gap, xi, {box[0]: box[0] - box_gap + xi}) and is_nonnegative(xi),
        "D_diag⋆ in the box: ξ + ξ' = 0": holds_on(box_gap + (total(diag) - total(box)), 0, {}),
        "ξ ≥ 0 and ξ = −ξ' ≤ 0 give ξ = 0": both.is_zero is True,
        "diagonal gap = Σ(h_t(D_diag⋆) − h_t(D⋆)) ≥ 0 term by term": holds_on(
            diag_gap, total(over), {o: d - s for o, d, s in zip(over, diag, star)}
        )
        and is_nonnegative(total(over)),
    }


def token_local_steps() -> dict[str, bool]:
    """Under (18) with unit keys, ``h(d) + 1/2 = (1 − a)²/2 ≥ 0``, with equality at ``a = 1``."""
    a = sp.Symbol("a", real=True)
    h = ((1 - a) ** 2 - 1) / 2
    return {
        "h + 1/2 = (1 − a)²/2": vanishes(h + sp.Rational(1, 2) - (1 - a) ** 2 / 2),
        "(1 − a)²/2 ≥ 0": is_nonnegative((1 - a) ** 2 / 2),
        "= 0 at a = 1": h.subs(a, 1) == -sp.Rational(1, 2),
    }


def box_gap_example(beta=sp.Rational(1, 4), box=(sp.Rational(1, 2), sp.Integer(2))) -> Witness:
    """K = 1, unit key, one token under (18): best over R at d = 1/β, best over the box at d_max."""
    d = sp.Symbol("d", real=True)
    h = ((1 - beta * d) ** 2 - 1) / 2
    unrestricted = sp.minimum(h, d, sp.S.Reals)
    boxed = sp.minimum(h, d, sp.Interval(*box))
    return Witness(
        "a box gap > 0 (β < 1/d_max)",
        boxed - unrestricted,
        ">",
        0,
        instance={"beta": beta, "d_min": box[0], "d_max": box[1], "min over R": unrestricted, "min over box": boxed},
        sizes={"K": 1, "T": 1},
    )


def check_decomposition() -> Outcome:
    proof = derive("decomposition and gap signs", decomposition_steps, T=TS)
    local = Derivation("the paper's example, under the token-local surrogate (18)", token_local_steps())
    example = box_gap_example()
    return conclude(
        "The three-term decomposition is an identity; the box gap is ≥ 0 and vanishes when the unrestricted "
        "diagonal optimum lies in the box; the diagonal gap is ≥ 0 term by term because D⋆ minimises each h_t "
        f"({format_sizes(proof.sizes)}). The paper's example (β_t⟨d, k_t²⟩ ≡ 1 inside the box) is about the "
        "token-local surrogate (18) — there h_t(d) + 1/2 = (1 − a_t)²/2, so such a d minimises every h_t and "
        "the box gap is 0 — whereas the decomposition's h_t is the population feedback (16), which has no β_t. "
        f"The box gap need not vanish: one unit-key token with β = {example.instance['beta']} has best value "
        f"{example.instance['min over R']} over R but {example.instance['min over box']} over [1/2, 2].",
        [proof, local, example],
    )


CLAIMS = [
    Claim(
        id="d3-regret-decomposition",
        location="App. D.3, 'Diagonal comparator gap'",
        quote="The middle term is the price paid for the box constraint and vanishes whenever an "
        "unrestricted diagonal optimum already lies inside",
        statement="Regret to D⋆ = projected-OGD regret + box/projection gap + diagonal gap; the box gap "
        "vanishes whenever an unrestricted diagonal optimum lies inside [d_min, d_max]^K.",
        method=f"sympy, {format_sizes({'T': TS})}: the identity with every h_t value symbolic; minimality "
        "written as nonnegative slacks; the example under (18); an exact K = 1 box gap.",
        expected="verified",
        check=check_decomposition,
    ),
]
