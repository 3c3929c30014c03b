"""App. D.4, "what the theorem controls": perfect token-local writes need not approach the population optimum.

Setting: K = V = 1, k_t = 1, v_t = (−1)^t, exact local writes β_t⟨d_t, s_t⟩ = 1 (here β_t = d_t = 1),
S_0 = 0; token loss ``f_t(S) = ½(S − v_t)²``; population loss over one period
``F(S) = ½ · mean_t (S − v_t)² = ½(S² + 1)``.

Proved: (i) for every state ``S``, one exact write gives ``S' = v_t`` (so by induction, for symbolic
integer t, ``S_{t−1} = (−1)^{t−1} ⇒ S_t = (−1)^t``), hence ``f_t(S_t) = 0``; (ii) ``f_t(S_{t−1}) = 2`` for
t ≥ 2 (symbolic t) and ``f_1(S_0) = ½``, so ``q_t = 0`` for every t ≥ 1 and ``Π q_t = 0``; (iii) ``F`` is
minimised at ``S* = 0`` with ``F(S*) = ½`` while ``F(S_t) = 1`` and ``|S_t − S*| = 1`` for every t.
Also replayed explicitly for t = 1..8.
"""

from __future__ import annotations

import sympy as sp

from ._claims import Claim, Outcome, conclude
from ._evidence import Derivation, format_sizes
from ._sym import all_of, holds_on, relation, vanishes

__all__ = ["CLAIMS", "REPLAY_STEPS", "exact_write", "replay", "token_loss"]

#: tokens replayed explicitly (the induction covers every t)
REPLAY_STEPS = 8


def token_loss(S, t) -> sp.Expr:
    """``f_t(S) = ½(S k_t − v_t)²`` with ``k_t = 1``, ``v_t = (−1)^t`` (exact: arguments are sympified)."""
    S, t = sp.sympify(S), sp.sympify(t)
    return (S - (-1) ** t) ** 2 / 2


def exact_write(S, t, beta=1, d=1) -> sp.Expr:
    """One OSDN write ``S + β u (d k)`` with ``k = 1`` and ``u = v_t − S``."""
    S, t, beta, d = (sp.sympify(x) for x in (S, t, beta, d))
    return S + beta * ((-1) ** t - S) * d


def replay(steps: int) -> list[tuple[sp.Expr, sp.Expr, sp.Expr]]:
    """States from ``S_0 = 0``: a list of ``(S_t, f_t(S_{t−1}), f_t(S_t))`` for t = 1..steps."""
    S, rows = sp.Integer(0), []
    for t in range(1, steps + 1):
        S_new = exact_write(S, t)
        rows.append((S_new, token_loss(S, t), token_loss(S_new, t)))
        S = S_new
    return rows


def check_counterexample() -> Outcome:
    t = sp.Symbol("t", integer=True, positive=True)
    S, x = sp.Symbol("S", real=True), sp.Symbol("x", real=True)
    F = ((x - 1) ** 2 + (x + 1) ** 2) / 4  # ½ · mean over one period
    S_star = sp.solve(sp.diff(F, x), x)
    induction = Derivation(
        "symbolic t (induction)",
        {
            "any S: exact write lands on v_t": vanishes(exact_write(S, t), (-1) ** t),
            "induction: S_{t−1} = (−1)^{t−1} ⇒ S_t = (−1)^t": vanishes(
                exact_write((-1) ** (t - 1), t), (-1) ** t
            ),
            "f_t(S_t) = 0": holds_on(token_loss(S, t), 0, {S: (-1) ** t}),
            "f_t(S_{t−1}) = 2 for t ≥ 2": vanishes(token_loss((-1) ** (t - 1), t), 2),
            "f_1(S_0) = 1/2": relation(token_loss(0, 1), "=", sp.Rational(1, 2)),
            "population minimiser S* = 0 (F'' = 1 > 0)": all_of([
                relation(len(S_star), "=", 1), relation(S_star[0], "=", 0), relation(sp.diff(F, x, 2), "=", 1)
            ]),
            "F(S*) = 1/2 and F(±1) = 1": all_of([
                relation(F.subs(x, 0), "=", sp.Rational(1, 2)), relation(F.subs(x, 1), "=", 1),
                relation(F.subs(x, -1), "=", 1),
            ]),
        },
        sizes={"K": 1, "V": 1},
    )
    rows = replay(REPLAY_STEPS)
    replayed = Derivation(
        "explicit replay",
        {
            f"t={i}: S_t = (−1)^t, f_t(S_t) = 0 < f_t(S_(t−1)), |S_t − S*| = 1": all_of([
                relation(S_t, "=", (-1) ** i), relation(after, "=", 0), relation(before, ">", 0),
                relation(abs(S_t - 0), "=", 1),
            ])
            for i, (S_t, before, after) in enumerate(rows, 1)
        },
        sizes={"K": 1, "V": 1, "t": tuple(range(1, len(rows) + 1))},
    )
    return conclude(
        "From S_0 = 0 the exact writes give S_t = (−1)^t (induction on symbolic t, replayed for "
        f"{format_sizes({'t': replayed.sizes['t']})}): f_t(S_t) = 0 and f_t(S_{{t−1}}) = 2 for t ≥ 2 "
        "(f_1(S_0) = ½), so every q_t = 0 and Π q_t = 0, while the population minimiser is S* = 0 with F(S*) = ½, "
        "F(S_t) = 1 and |S_t − S*| = 1 for all t.",
        [induction, replayed],
        numbers={
            "f_before_t_ge_2": 2.0,
            "f_before_t1": 0.5,
            "F_star": 0.5,
            "F_at_S_t": 1.0,
            "distance_to_S_star": 1.0,
        },
    )


CLAIMS = [
    Claim(
        id="app-d4-alternating-counterexample",
        location="App. D.4, 'What the theorem controls'",
        quote="each token-local residual is driven to zero, so ∏ t q t = 0 trivially, yet S t alternates "
        "between ± 1 and never approaches the population minimiser S ⋆ = 0 .",
        statement="With K = V = 1, k_t = 1, v_t = (−1)^t and exact local writes, every token-local "
        "residual is driven to 0 (Π q_t = 0) yet S_t = ±1 never approaches the population "
        "minimiser S* = 0.",
        method="sympy: one-step induction with integer symbol t; token losses before/after; minimiser "
        f"of the period-averaged loss; exact replay for {format_sizes({'t': range(1, REPLAY_STEPS + 1)})}.",
        expected="verified",
        check=check_counterexample,
    ),
]
