"""Symbolic (sympy) checks of the OSDN paper's mathematics, and the claims ledger that runs them.

Installed as ``osdn_diag.proofs``. Each module proves one group of claims and exports them as
``CLAIMS``; :mod:`.ledger` collects them and is what ``osdn-diag prove`` runs; :mod:`.ledger_doc`
writes ``docs/ledger.md`` from it. Every claim carries the paper's location and its words there
(``Claim.quote``). Modules whose name starts with an underscore hold shared machinery: evidence and
claims, sympy helpers, inequalities proved by induction (:mod:`._inequalities`) and the supporting fp64
sweeps (:mod:`._sweep`), which are reported as numbers and never count as evidence.

Notation shared by every module: state ``S ∈ R^{V×K}``, key ``k``, value ``v``, gate ``β``,
preconditioner ``d``, ``s = k ⊙ k``, ``n = ‖k‖²``, residual ``u = v − S k``, OSDN write
``S' = S + β u (d ⊙ k)ᵀ``, token loss ``f(S) = ½‖S k − v‖²``, surrogate
``h(d) = (f(S') − f(S)) / ‖∇f(S)‖²`` with ``‖∇f(S)‖² = ‖u‖² n``, write gain ``a = β⟨d, s⟩``.

A proof here is a derivation: an identity is accepted only when the difference of its two sides
expands to exactly 0, and an inequality only when the quantity has been rewritten (by a checked
identity) as an expression whose sign sympy derives from the symbols' declared assumptions. Each
step is a :class:`._sym.Check` made by those helpers, which keeps what it decided so that a test can
perturb it (its negative control: the perturbed step must fail); a value typed in as a step, such as a
constant ``True``, establishes nothing.

A check returns the evidence it computed (:mod:`._evidence`: derivations with the sizes they ran
on, counterexamples and witnesses with their exact numbers, conditionals), and the claim's status
is derived from it (:func:`._claims.status_of`): a counterexample refutes, a hypothesis that is
needed makes it conditional, derivations and witnesses alone verify. A check that cannot establish
its claim reports ``failed``, never ``verified``.
"""
