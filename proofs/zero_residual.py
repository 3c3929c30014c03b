"""Tokens with a zero residual (App. D.4): the paper's convention, and two repairs of Theorem D.7.

Notation as in :mod:`.theorem_d7` (unit keys, ``a_t(x) = β_t⟨x, s_t⟩``, ``q_t``, ``ε_T``, ``R_T``).

* The paper (after Eq. 18): Eq. (18) is "valid whenever ‖∇f_t(S_{t−1})‖ = ‖u_t‖‖k_t‖ > 0, and continuously
  extended by h_t ≡ 0 on the residual-zero set {u_t = 0}". On ``u ≠ 0`` the definition of ``h_t`` *is*
  Eq. (18) — a function of ``d`` that does not depend on ``u`` — so its limit as ``u → 0`` is Eq. (18),
  ``((1 − a)² − 1)/(2n) = a(a − 2)/(2n)``, which is 0 only when ``a ∈ {0, 2}``. ``h_t ≡ 0`` is therefore
  a discontinuous convention; with it (and ``q_t = 1``) Theorem D.7 fails
  (``thm-d7-zero-residual-convention``).
* Repair 1, *drop*: take the product, ``ε`` and ``R`` over the tokens with ``u_t ≠ 0`` only (``T`` → their
  number ``T'``). Those tokens form a stream to which the theorem's proof applies as it stands (each
  ``q_t = (1 − a_t)²`` depends only on its own gain), and the dropped tokens contribute the factor 1.
* Repair 2, *continuous*: keep every token, with ``q_t := (1 − a_t)²`` — the continuous extension of
  ``f_t(S_t)/f_t(S_{t−1})``, which equals ``(1 − a_t)²`` for every ``u_t ≠ 0`` — and ``h_t`` from Eq. (18)
  everywhere. Then ``mean q = 2ε_T(d) + 2R_T(d)/T`` holds over all T tokens and the theorem holds with
  the original ``T``.

Checked: the limits with every symbol free (K = V = 1), the identities over every kept subset of
T = 1..4 symbolic tokens (K = 2), and exact streams, including the paper's all-zero-residual stream.
"""

from __future__ import annotations

import itertools

import sympy as sp

from ._claims import Claim, Outcome, conclude
from ._evidence import Counterexample, Derivation, Witness, derive, format_sizes
from ._inequalities import am_gm_steps
from ._sym import vanishes
from .lemma_4_1 import surrogate_closed_form
from .theorem_d7 import TS, realised_regret_identity, stream

__all__ = ["CLAIMS", "limit_steps", "mixed_stream", "run_stream", "subset_steps"]

#: K of the symbolic streams
_K = 2


def limit_steps() -> dict[str, bool]:
    """K = V = 1 with every symbol free: as ``u → 0`` the ratio tends to ``(1 − a)²`` and ``h`` to Eq. (18)."""
    S, k, beta, d, eps = sp.symbols("S k beta d epsilon", real=True)
    k = sp.Symbol("k", positive=True)  # k ≠ 0
    v = S * k + eps  # u = ε
    S_new = S + beta * eps * d * k
    f = lambda X: (X * k - v) ** 2 / 2  # noqa: E731
    a = beta * d * k**2
    ratio = f(S_new) / f(S)
    h = (f(S_new) - f(S)) / (eps**2 * k**2)
    eq18 = surrogate_closed_form(a, k**2)
    return {
        "ratio = (1 − a)² for every u ≠ 0": vanishes(ratio, (1 - a) ** 2),
        "lim_{u→0} ratio = (1 − a)²": vanishes(sp.limit(ratio, eps, 0), (1 - a) ** 2),
        "h = Eq. (18) for every u ≠ 0": vanishes(h, eq18),
        "lim_{u→0} h = Eq. (18)": vanishes(sp.limit(h, eps, 0), eq18),
        "Eq. (18) = a(a − 2)/(2n): zero only at a ∈ {0, 2}": vanishes(eq18, a * (a - 2) / (2 * k**2)),
    }


def _limit_counterexample() -> Counterexample:
    """k = 1, β = 1/2, d = 1 (a = 1/2): lim_{u→0} h = −3/8, not the convention's 0."""
    eps = sp.Symbol("epsilon", real=True)
    S, k, beta, d = sp.Integer(0), sp.Integer(1), sp.Rational(1, 2), sp.Integer(1)
    v = S * k + eps
    S_new = S + beta * eps * d * k
    h = ((S_new * k - v) ** 2 / 2 - (S * k - v) ** 2 / 2) / (eps**2 * k**2)
    return Counterexample(
        "h_t ≡ 0 is not the limit at u_t = 0",
        sp.limit(h, eps, 0),
        "=",
        0,  # claimed: the extension by 0 is continuous
        instance={"S": S, "k": k, "beta": beta, "d": d, "a": beta * d * k**2},
        sizes={"K": 1, "V": 1},
    )


def subset_steps(T: int, K: int = _K) -> dict[str, bool]:
    """Drop repair: over every nonempty kept subset of T tokens, mean q = 2ε + 2R/T' (comparator cancels)."""
    z = stream(T, K)
    steps = {}
    for size in range(1, T + 1):
        for kept in itertools.combinations(range(T), size):
            mean_q = sum(z.q(t) for t in kept) / size
            eps = sum((1 - z.gain(t, z.d)) ** 2 for t in kept) / (2 * size)
            regret = sum(z.h(t, z.traj[t]) - z.h(t, z.d) for t in kept)
            name = "{" + ", ".join(str(t + 1) for t in kept) + "}"
            steps[f"kept {name}: mean q = 2ε + 2R/T'"] = vanishes(2 * eps + 2 * regret / size, mean_q)
    return steps


def run_stream(values, betas, learner, d_star, k=1, S0=0) -> dict:
    """An exact K = V = 1 stream: residuals, both products and the bounds of both repairs and of the
    paper's convention, at the comparator ``d_star``."""
    k, S = sp.nsimplify(k), sp.nsimplify(S0)
    rows = []
    for v, beta, d in zip(values, betas, learner):
        v, beta, d = sp.nsimplify(v), sp.nsimplify(beta), sp.nsimplify(d)
        u = v - S * k
        a, a_star = beta * d * k**2, beta * d_star * k**2
        rows.append({"u": u, "q": (1 - a) ** 2, "h": surrogate_closed_form(a, k**2),
                     "h_star": surrogate_closed_form(a_star, k**2), "gap": (1 - a_star) ** 2})
        S = S + beta * u * d * k

    def bound(selected, zero_h=False):
        n = len(selected)
        if n == 0:
            return sp.Integer(1)  # an empty stream: empty product and empty bound
        eps = sum(r["gap"] for r in selected) / (2 * n)
        regret = sum(0 if zero_h and r["u"] == 0 else r["h"] - r["h_star"] for r in selected)
        return (2 * eps + 2 * regret / n) ** n

    kept = [r for r in rows if r["u"] != 0]
    return {
        "T": len(rows),
        "kept": len(kept),
        "prod_drop": sp.Mul(*[r["q"] for r in kept]),
        "bound_drop": bound(kept),
        "prod_continuous": sp.Mul(*[r["q"] for r in rows]),
        "bound_continuous": bound(rows),
        "prod_convention": sp.Mul(*[r["q"] if r["u"] != 0 else 1 for r in rows]),
        "bound_convention": bound(rows, zero_h=True),
    }


#: the paper's all-zero-residual stream (v_t = 0 from S_0 = 0, β_t = 1/2, d_t = d* = 2), T = 4
_ZERO = {"values": (0, 0, 0, 0), "betas": ("1/2",) * 4, "learner": (2, 2, 2, 2), "d_star": 2}
#: a mixed stream: after token 1's partial write, tokens 2 and 3 ask for the value already stored (u = 0);
#: d* = 2 lies in the box and meets the gated Newton condition
_MIXED = {"values": ("1/2", "1/4", "1/4", "3/2"), "betas": ("1/2",) * 4, "learner": (1, 1, 1, "3/2"), "d_star": 2}


def mixed_stream() -> dict:
    """The mixed stream's exact values (tokens 2 and 3 have u = 0)."""
    return run_stream(**_MIXED)


def _witness(label, z, prod, bound, params) -> Witness:
    return Witness(
        label,
        z[prod],
        "<=",
        z[bound],
        instance={**{key: str(val) for key, val in params.items()}, "T": z["T"], "kept": z["kept"]},
        sizes={"K": 1, "V": 1, "T": z["T"]},
    )


def check_discontinuous() -> Outcome:
    limits = Derivation("limits at u = 0 (K = V = 1, every symbol free)", limit_steps())
    counter = _limit_counterexample()
    return conclude(
        "For every u ≠ 0 the definition of h_t equals Eq. (18), which does not depend on u, so its limit at "
        "u_t = 0 is Eq. (18) = a(a − 2)/(2n), zero only when a ∈ {0, 2}; extending by h_t ≡ 0 is therefore not "
        f"continuous: with k = 1, β = 1/2, d = 1 the limit is {counter.lhs}. The continuous extensions are "
        "Eq. (18) for h_t and (1 − a_t)² for the ratio q_t (thm-d7-zero-residual-continuous); the "
        "discontinuous pair h_t ≡ 0, q_t = 1 is the one that breaks Theorem D.7 "
        "(thm-d7-zero-residual-convention).",
        [limits, counter],
    )


def check_drop() -> Outcome:
    proof = derive("every kept subset of a symbolic stream", subset_steps, T=TS, K=(_K,))
    induction = Derivation("AM–GM for every T (induction on n)", am_gm_steps())
    mixed, zero = run_stream(**_MIXED), run_stream(**_ZERO)
    witnesses = [
        _witness("mixed stream, zero-residual token dropped", mixed, "prod_drop", "bound_drop", _MIXED),
        _witness("the paper's zero-residual stream: nothing kept", zero, "prod_drop", "bound_drop", _ZERO),
    ]
    return conclude(
        "Over the tokens with u_t ≠ 0 (T' of them) the realised-regret identity mean q = 2ε_{T'}(d) + "
        "2R_{T'}(d)/T' holds for every kept subset and every comparator "
        f"({format_sizes(proof.sizes)}), so with AM–GM (every T, by induction) Π_{{u_t ≠ 0}} q_t ≤ "
        "(2ε_{T'}(d) + 2R_{T'}(d)/T')^{T'}; the dropped tokens contribute the factor 1. Exact streams: a "
        f"mixed one (tokens 2 and 3 ask for the value already stored, u = 0): {mixed['prod_drop']} ≤ "
        f"{mixed['bound_drop']} with T' = {mixed['kept']}; the paper's all-zero-residual stream keeps no token "
        "(an empty product, 1 ≤ 1).",
        [proof, induction, *witnesses],
    )


def check_continuous() -> Outcome:
    limits = Derivation("limits at u = 0 (K = V = 1, every symbol free)", limit_steps())
    proof = derive("identity over all T tokens with q_t := (1 − a_t)²", realised_regret_identity, T=TS, K=(_K,))
    induction = Derivation("AM–GM for every T (induction on n)", am_gm_steps())
    mixed, zero = run_stream(**_MIXED), run_stream(**_ZERO)
    witnesses = [
        _witness("mixed stream, all tokens", mixed, "prod_continuous", "bound_continuous", _MIXED),
        _witness("the paper's zero-residual stream", zero, "prod_continuous", "bound_continuous", _ZERO),
    ]
    return conclude(
        "q_t := (1 − a_t)² is the limit of f_t(S_t)/f_t(S_{t−1}) as u_t → 0 and Eq. (18) that of h_t; with "
        "them at every token, mean q = 2ε_T(d) + 2R_T(d)/T over all T tokens "
        f"({format_sizes(proof.sizes)}) and AM–GM gives Theorem D.7 with the original T. On the paper's "
        f"zero-residual stream the product is {zero['prod_continuous']} ≤ {zero['bound_continuous']} (where the "
        f"convention gives {zero['prod_convention']} > {zero['bound_convention']}); on the mixed stream "
        f"{mixed['prod_continuous']} ≤ {mixed['bound_continuous']} (the convention: {mixed['prod_convention']} > "
        f"{mixed['bound_convention']}).",
        [limits, proof, induction, *witnesses],
    )


CLAIMS = [
    Claim(
        id="d4-h-zero-extension-continuous",
        location="App. D.4, after Eq. (18) ('continuously extended by h_t ≡ 0 on the residual-zero set')",
        quote="and continuously extended by h t ≡ 0 on the residual-zero set { u t = 0 } .",
        statement="Extending h_t by 0 on {u_t = 0} is a continuous extension of Eq. (18).",
        method="sympy, K = V = 1 with every symbol free: the definition of h and the ratio for u ≠ 0 and "
        "their limits as u → 0; an exact gain a = 1/2.",
        expected="refuted",
        check=check_discontinuous,
    ),
    Claim(
        id="thm-d7-zero-residual-drop",
        location="App. D.4, Thm D.7 (repair of the zero-residual convention)",
        quote="Defining q t := f t ( S t ) / f t ( S t − 1 ) on the non-degenerate set { u t ≠ 0 }",
        statement="Repair 1: dropping the tokens with u_t = 0 (T → their complement's count T'), Theorem D.7's "
        "bound holds for the rest: Π_{u_t ≠ 0} q_t ≤ (2ε_{T'}(d) + 2R_{T'}(d)/T')^{T'}.",
        method=f"sympy, {format_sizes({'T': TS, 'K': (_K,)})}: the realised-regret identity over every nonempty "
        "kept subset; AM–GM by induction; exact K = V = 1 streams.",
        expected="verified",
        check=check_drop,
    ),
    Claim(
        id="thm-d7-zero-residual-continuous",
        location="App. D.4, Thm D.7 and Eq. (20) (repair of the zero-residual convention)",
        quote="Defining q t := f t ( S t ) / f t ( S t − 1 ) on the non-degenerate set { u t ≠ 0 }",
        statement="Repair 2: with q_t := (1 − a_t)² at every token (the continuous extension of the ratio) and "
        "h_t from Eq. (18) everywhere, Theorem D.7 holds with the original T.",
        method=f"sympy: limits at u = 0 (K = V = 1); the realised-regret identity over all tokens "
        f"({format_sizes({'T': TS, 'K': (_K,)})}); AM–GM by induction; exact streams including the paper's "
        "zero-residual one.",
        expected="verified",
        check=check_continuous,
    ),
]
