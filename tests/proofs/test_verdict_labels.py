"""Verdict labels say whose statement was checked and what was found: the paper's refuted statements are
counted apart from the package's own, the super-geometric clause is conditional on u_t ≠ 0 only, Listings
2–3 are checked as printed, and the measurement count is labelled as the consistency check it is."""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from osdn_diag.proofs import _sweep, chunk_outputs, ledger, paper_numbers

README = Path(__file__).resolve().parents[2] / "README.md"


def test_refuted_counted_by_whose_statement(ledger_json):
    claims = ledger_json["claims"]
    refuted = {src: sorted(r["id"] for r in claims if r["status"] == "refuted" and r["source"] == src)
               for src in ("paper", "package")}
    assert refuted["package"] == ["momentum-writes-contract", "rwkv7-writes-contract"]
    assert len(refuted["paper"]) == 4
    by_source = ledger_json["summary"]["by_source"]
    assert by_source["paper"]["refuted"] == 4 and by_source["package"]["refuted"] == 2
    assert all(r["source"] == "package" for r in claims if r["location"].count("fla"))


def test_prove_summary_splits_the_counts(ledger_results):
    line = ledger.format_table(ledger_results).splitlines()[-1]
    paper = sum(r.claim.source == "paper" and r.outcome.status == "refuted" for r in ledger_results)
    assert f"{paper} refuted" in line.split("the paper's statements: ")[1].split(";")[0]
    assert "the package's statements: " in line and "2 refuted" in line.split("the package's statements: ")[1]


def test_readme_counts_match_the_ledger(ledger_json):
    text = " ".join(README.read_text(encoding="utf-8").split())
    s = ledger_json["summary"]
    match = re.search(r"— (\d+) entries, .*?: (\d+) verified, (\d+) conditional, (\d+) refuted — (\d+) of the "
                      r"paper's statements and (\d+) of the package's own", text)
    assert match, "README's ledger count sentence not found"
    assert tuple(map(int, match.groups())) == (
        len(ledger_json["claims"]), s["verified"], s["conditional"], s["refuted"],
        s["by_source"]["paper"]["refuted"], s["by_source"]["package"]["refuted"],
    )


def test_super_geometric_is_conditional_on_nonzero_residuals_only(ledger_json):
    (r,) = [r for r in ledger_json["claims"] if r["id"] == "thm-5.2-super-geometric"]
    assert (r["status"], r["condition"]) == ("conditional", "u_t ≠ 0 at every token")
    (without,) = r["evidence"][0]["without"]
    assert without["instance"]["v_t"] == "0" and without["instance"]["d*"] == without["instance"]["d_t"] == "2"
    # the paper's own hypothesis (the Newton condition) shows up as a witness, never as the condition
    assert [e["kind"] for e in r["evidence"]] == ["conditional", "witness"]


def _printed_listing_torch(q, k, kt, v, beta, alpha, S, kind):
    """Listings 2–3 transcribed in torch (fp64): write key / cumulative decay floored at 1e-6."""
    q, k, kt, v, beta, alpha, S = (torch.as_tensor(x, dtype=torch.float64) for x in (q, k, kt, v, beta, alpha, S))
    C = k.shape[0]
    gamma = torch.cumprod(alpha, dim=0)
    g = gamma[:, None] if kind == "gated" else gamma
    gk, gq, nk = g * k, g * q, kt / g.clamp_min(1e-6)
    lower = torch.tril(gk @ nk.T * beta[:, None], -1)
    ut = torch.linalg.solve_triangular(torch.eye(C, dtype=torch.float64) + lower,
                                       torch.diag(beta), upper=False)
    state = S.T if kind == "gated" else S
    update = ut @ v - (ut @ gk) @ state
    return (gq @ state + torch.tril(gq @ nk.T) @ update).numpy()


def _tokens_torch(q, k, kt, v, beta, alpha, S, kind):
    q, k, kt, v, beta, alpha, S = (torch.as_tensor(x, dtype=torch.float64) for x in (q, k, kt, v, beta, alpha, S))
    out = []
    for i in range(k.shape[0]):
        if kind == "gated":
            S = alpha[i] * S
            S = S + beta[i] * torch.outer(v[i] - S @ k[i], kt[i])
            out.append(S @ q[i])
        else:
            S = torch.diag(alpha[i]) @ S
            S = S + beta[i] * torch.outer(kt[i], v[i] - S.T @ k[i])
            out.append(S.T @ q[i])
    return torch.stack(out).numpy()


def test_listing_clamp_drift_reproduced_independently(ledger_json):
    records = {r["id"]: r for r in ledger_json["claims"]}
    for claim, kind in (("chunk-output-listing-2", "gated"), ("chunk-output-app-b2", "kda")):
        recorded = records[claim]["numbers"]["listing_clamp_fp64"]
        assert (recorded["C"], recorded["seeds"]) == (64, 20)
        for a, value in recorded["median_rel_output_err"].items():
            errs = []
            for seed in range(20):
                q, k, kt, v, beta, alpha, S = _sweep._data(np.random.default_rng(seed), 64, kind)
                alpha = np.full_like(alpha, float(a))
                o_tok = _tokens_torch(q, k, kt, v, beta, alpha, S, kind)
                o_lst = _printed_listing_torch(q, k, kt, v, beta, alpha, S, kind)
                errs.append(np.linalg.norm(o_lst - o_tok) / np.linalg.norm(o_tok))
            assert abs(np.median(errs) - value) <= 1e-6 * value, (claim, a)
        errs = recorded["median_rel_output_err"]
        assert 0.01 < errs["0.8"] < 0.03 and 0.3 < errs["0.75"] < 0.45
        assert f"{errs['0.8']:.1%} at α = 0.8" in records[claim]["detail"]


def test_unclamped_listing_is_not_the_printed_one():
    """With no floor the two-token chunk reads the recurrence exactly: the failure is the clamp's."""
    one, S = __import__("sympy").Matrix([[1], [1]]), __import__("sympy").zeros(1, 1)
    alpha, beta = (1, Fraction(1, 10**7)), (Fraction(1, 2),) * 2
    import sympy as sp
    alpha, beta = tuple(map(sp.nsimplify, alpha)), tuple(map(sp.nsimplify, beta))
    tokens = chunk_outputs.token_outputs(S, one, one, one, one, beta, alpha)
    assert chunk_outputs.gated_chunk_output(S, one, one, one, one, beta, alpha)[1, 0] == tokens[1, 0]
    printed = chunk_outputs.gated_chunk_output(S, one, one, one, one, beta, alpha, clamp=chunk_outputs.LISTING_CLAMP)
    assert printed[1, 0] != tokens[1, 0]


def test_measurement_count_is_conditional_on_the_unstated_prompt_length():
    """The paper gives no prompt lengths: the count holds only if the prompts average what it implies, and
    prompts filling the 2K context (as the package's paper-scale run does) would give another count."""
    ok = paper_numbers.check_measurements()
    assert ok.status == "conditional" and ok.numbers["tokens_per_prompt"] == float(Fraction(785 * 10**4, 9216))
    low, high = Fraction(7845 * 10**3, 9216), Fraction(7855 * 10**3, 9216)
    assert f"{float(low):.1f}–{float(high):.1f} tokens" in ok.condition
    (cond,) = ok.evidence
    assert [w.holds for w in cond.under] == [True, True] and cond.without[0].holds is False
    assert cond.without[0].instance["count"] == str(9216 * 2048)
    assert paper_numbers.check_measurements(Fraction(2 * 10**7)).status == "failed"  # 2170 tokens per prompt
