"""What each claim's proof covered, as the ledger's JSON records it.

The sizes below are written out by hand from the proof modules: a proof that is weakened (a smaller
grid of K, V, T or C, fewer tokens replayed, fewer steps, a counterexample dropped) fails here even
when its prose is unchanged. The prose itself must name the sizes that were recorded.
"""

from __future__ import annotations

import re

import pytest

from osdn_diag.proofs import ledger

K14 = {"K": [1, 2, 3, 4]}
KV = {"K": [1, 2, 3, 4], "V": [1, 2]}
SHAPE_340M = {"L": [24], "H": [8], "d_k": [128], "d_v": [128]}
SHAPE_1_3B = {"L": [24], "H": [16], "d_k": [128], "d_v": [128]}

#: per claim, in order: (kind, sizes, number of steps) of every piece of evidence; pieces nested in a
#: conditional are marked "under …" / "without …"; steps is None for an instance
COVERED = {
    "lemma-4.1-closed-form": [("derivation", KV, 32), ("derivation", {}, 1), ("witness", {"K": [2], "V": [1]}, None)],
    "lemma-4.1-gradient": [("derivation", KV, 8)],
    "lemma-4.1-decoupling": [("derivation", KV, 8)],
    "lemma-4.1-ratio-vs-surrogate": [("derivation", KV, 8), ("derivation", {}, 3), ("witness", {"K": [2]}, None)],
    "eq-2-write-key-equivalence": [("derivation", {"K": [1, 2, 3], "V": [1, 2]}, 24), ("derivation", {}, 2)],
    "sec-4.5-backward-factorisation": [("derivation", {"K": [1, 2, 3]}, 24)],
    "corollary-a2-monotone-descent": [("derivation", K14, 24)],
    "corollary-a2-hypotheses-needed": [("witness", {"K": [1]}, None), ("witness", {"K": [1]}, None)],
    "lemma-d6-hessian": [("derivation", K14, 24)],
    "prop-a1-smoothness": [("derivation", K14, 12), ("derivation", {}, 2)],
    "prop-a3-apf-affine": [("derivation", K14, 40)],
    "app-a5-apf-proximal-form": [
        ("conditional", {}, None),
        ("under derivation", {"K": [1, 2, 3]}, 15),
        ("without counterexample", {"K": [1]}, None),
    ],
    "property-1-population-quadratic": [
        ("derivation", {"K": [1, 2, 3], "V": [1, 2]}, 36),
        ("derivation", {"K": [1, 2], "V": [1, 2]}, 4),
        ("derivation", {"K": [2], "V": [1]}, 6),
    ],
    "lemma-d1-feedback-convex": [("derivation", {"K": [1, 2], "V": [1, 2]}, 16)],
    "lemma-d3-newton-feedback": [
        ("derivation", {}, 4),
        ("derivation", {"K": [1, 2, 3], "V": [1, 2]}, 24),
        ("derivation", {"K": [2], "V": [1, 2]}, 12),
        ("derivation", {}, 2),
        ("derivation", {"K": [1, 2, 3], "V": [1, 2]}, 18),
        ("witness", {"K": [2], "V": [1]}, None),
        ("witness", {"K": [2], "V": [1]}, None),
    ],
    "thm-d5-term-by-term": [("derivation", {"K": [1, 2, 3], "V": [1, 2]}, 18), ("derivation", {"T": [1]}, 6)],
    "thm-5.1-population-bound": [
        ("derivation", {"T": [1, 2, 3, 4]}, 54),
        ("derivation", {}, 11),
        ("witness", {"K": [2], "V": [1], "T": [3]}, None),
    ],
    "d3-regret-decomposition": [
        ("derivation", {"T": [1, 2, 3, 4]}, 4),
        ("derivation", {"T": [1, 2, 3], "K": [1, 2]}, 12),
        ("derivation", {"K": [1, 2, 3], "V": [1, 2]}, 18),
        ("derivation", {}, 3),
        ("witness", {"K": [1], "T": [1]}, None),
        ("witness", {"K": [1], "T": [1]}, None),
    ],
    "thm-d7-proof-steps": [
        ("derivation", {"T": [1, 2, 3, 4], "K": [2]}, 16),
        ("derivation", {"T": [2]}, 2),
        ("derivation", {}, 8),
    ],
    "thm-d7-realised-regret-identity": [("derivation", {"T": [1, 2, 3, 4], "K": [2]}, 8)],
    "thm-d7-zero-residual-convention": [
        *[("counterexample", {"K": [1], "V": [1], "T": [T]}, None) for T in (1, 2, 3, 4) for _ in range(2)],
        ("derivation", {}, 1),
    ],
    "d4-h-zero-extension-continuous": [("derivation", {}, 5), ("counterexample", {"K": [1], "V": [1]}, None)],
    "thm-d7-zero-residual-drop": [
        ("derivation", {"T": [1, 2, 3, 4], "K": [2]}, 26),
        ("derivation", {}, 8),
        *[("witness", {"K": [1], "V": [1], "T": [4]}, None)] * 2,
    ],
    "thm-d7-zero-residual-continuous": [
        ("derivation", {}, 5),
        ("derivation", {"T": [1, 2, 3, 4], "K": [2]}, 8),
        ("derivation", {}, 8),
        *[("witness", {"K": [1], "V": [1], "T": [4]}, None)] * 2,
    ],
    "thm-5.2-newton-overdetermined": [
        ("derivation", {"K": [1, 2, 3]}, 3),
        ("witness", {"K": [2], "T": [3]}, None),
        ("witness", {"K": [2], "T": [2]}, None),
    ],
    "thm-5.2-super-geometric": [
        ("conditional", {}, None),
        ("under derivation", {"T": [1, 2, 3, 4]}, 4),
        ("under derivation", {}, 2),
        ("without counterexample", {"K": [1], "V": [1]}, None),
        ("witness", {"K": [1]}, None),
    ],
    "app-d4-alternating-counterexample": [
        ("derivation", {"K": [1], "V": [1]}, 7),
        ("derivation", {"K": [1], "V": [1], "t": [1, 2, 3, 4, 5, 6, 7, 8]}, 8),
    ],
    "corollary-d8-repeated-key": [
        ("derivation", {"K": [2, 4], "V": [1, 2]}, 28),
        ("derivation", {"T": [2, 3, 4]}, 44),
        ("witness", {"K": [2], "V": [1], "T": [2]}, None),
    ],
    "wy-chunk-asymmetric": [("derivation", {"C": [2, 3, 4], "K": [2], "V": [2]}, 9)],
    "wy-chunk-gated": [("derivation", {"C": [2, 3], "K": [2], "V": [1]}, 2)],
    "wy-chunk-kda": [("derivation", {"C": [2, 3], "K": [2], "V": [1]}, 2)],
    "chunk-output-listing-1": [("derivation", {"C": [2, 3, 4], "K": [2], "V": [1]}, 6)],
    "chunk-output-listing-2": [
        ("conditional", {}, None),
        ("under derivation", {"C": [2, 3, 4], "K": [2], "V": [1]}, 6),
        ("under derivation", {}, 1),
        ("without counterexample", {"C": [2], "K": [1], "V": [1]}, None),
    ],
    "chunk-output-app-b2": [
        ("conditional", {}, None),
        ("under derivation", {"C": [2, 3, 4], "K": [2], "V": [1]}, 6),
        ("under derivation", {}, 1),
        ("without counterexample", {"C": [2], "K": [1], "V": [1]}, None),
    ],
    "app-b1-post-gate-residual": [
        ("derivation", {"K": [1, 2], "V": [1, 2]}, 20),
        ("witness", {"K": [1], "V": [1]}, None),
    ],
    "app-c-osgdn-fixed-point": [
        ("conditional", {}, None),
        ("under derivation", {"K": [1, 2, 3]}, 9),
        ("without counterexample", {"K": [1]}, None),
        ("without counterexample", {"K": [1]}, None),
    ],
    "app-b-vs-listing-1-normaliser": [
        ("conditional", {}, None),
        ("under derivation", {"K": [1, 2, 3]}, 6),
        ("without counterexample", {"K": [2]}, None),
    ],
    "fig1-vs-algorithm-1": [("derivation", {}, 2), ("witness", {"K": [1]}, None)],
    "table-14-vs-tables-1-9-10": [("derivation", {}, 1), *[("witness", {}, None)] * 3],
    "app-e-vs-app-f-context": [("witness", {}, None)],
    "app-c-vs-b2-oskda-retention": [("witness", {}, None)],
    "app-l-vs-eq-12-normaliser": [
        ("conditional", {}, None),
        ("under derivation", {"K": [1, 2, 3]}, 6),
        ("without counterexample", {"K": [2]}, None),
    ],
    "app-d3-citations": [("derivation", {}, 2), ("witness", {"K": [1]}, None)],
    "app-l-state-overhead": [
        ("derivation", {}, 1),
        ("counterexample", SHAPE_340M, None),
        ("counterexample", SHAPE_1_3B, None),
        ("counterexample", {"L": [21], "H": [6], "d_k": [128], "d_v": [256]}, None),  # Gated DeltaNet 340M
        ("counterexample", {"L": [23], "H": [8], "d_k": [128], "d_v": [128]}, None),  # KDA 340M
        *[("counterexample", {}, None)] * 4,  # the four rows of Tables 19–20
    ],
    "reader-newton-infeasible": [("derivation", K14, 16)],
    "apf-parameter-share": [("witness", {}, None)] * 2,
    "headline-percentages": [("derivation", {}, 8)],
    "table-1-against-sources": [("derivation", {}, 25)],
    "throughput-deltas": [("derivation", {}, 19)],
    "table-7-averages": [("derivation", {}, 42)],
    "diagnostic-measurement-count": [
        ("conditional", {}, None),
        ("under witness", {}, None),
        ("under witness", {}, None),
        ("without counterexample", {}, None),
    ],
    "app-l-diagonal-mib-text": [("counterexample", {}, None)],
    # fla's further kernel families (proofs/family_*.py)
    "comba-one-token-contraction": [("derivation", {"K": [1, 2, 3], "V": [1, 2]}, 24)],
    "comba-gated-one-token": [("derivation", {"K": [1, 2, 3], "V": [1, 2]}, 18)],
    "gdn2-one-token-contraction": [
        ("derivation", {"K": [1, 2, 3], "V": [1, 2]}, 24),
        ("derivation", {"K": [1, 2, 3], "V": [1, 2]}, 6),
    ],
    "gdp-micro-step-contraction": [
        ("derivation", {"n": [1, 2], "K": [1, 2], "V": [1, 2]}, 32),
        ("witness", {"K": [1], "V": [1], "n": [2]}, None),
    ],
    "momentum-one-token-ratio": [("derivation", {"K": [1, 2, 3], "V": [1, 2]}, 18)],
    "momentum-writes-contract": [("counterexample", {"K": [1], "V": [1]}, None)],
    "rwkv7-one-token-ratio": [("derivation", {"K": [1, 2, 3], "V": [1, 2]}, 16)],
    "rwkv7-writes-contract": [("counterexample", {"K": [1], "V": [1]}, None)],
}

_ZERO_STREAM = {"k_t": "1", "v_t": "0", "S_0": "0", "beta_t": "1/2", "d_t": "2", "d*": "2"}

#: every counterexample (and the conditional's) as (relation, instance): the exact numbers
COUNTEREXAMPLES = {
    "thm-d7-zero-residual-convention": [
        ("1 <= 0", {**_ZERO_STREAM, "reading": reading})
        for _ in range(4)
        for reading in ("h_t ≡ 0 where u_t = 0", "h_t from Eq. (18)")
    ],
    "thm-5.2-super-geometric": [
        ("oo <= 0", {"k_t": "1", "v_t": "0", "S_0": "0", "beta_t": "1/2", "d_t": "2", "d*": "2", "rho": "1/2"}),
    ],
    "app-a5-apf-proximal-form": [
        (
            "64023999997/64000000000 = 16023999997/16000000000",
            {"k": "1/2000", "epsilon": "1/1000000", "beta": "1/2", "eta": "3/1000", "r": "1", "d": "1"},
        ),
    ],
    "app-c-osgdn-fixed-point": [
        ("3/7 = 1", {"k": "1", "rho": "999/1000", "eta": "3/1000", "beta": "1/2", "d_fixed": "6/7"}),
        ("1/2 = 1", {"k": "1", "rho": "1", "eta": "3/1000", "beta": "1/4", "d_fixed": "2", "Newton d": "4"}),
    ],
    **{
        claim: [(
            "20000019/400000000 = 20000001/40000000",
            {"q = k = k̃ = v": "1", "S": "0", "beta": "(1/2, 1/2)", "alpha": "(1, 1/10000000)",
             "gamma_2": "1/10000000", "clamp": "1/1000000"},
        )]
        for claim in ("chunk-output-listing-2", "chunk-output-app-b2")
    },
    "app-l-vs-eq-12-normaliser": [(
        "4009/16000 = 2009/8000",
        {"k": "(1, 1)", "d": "(1/4, 1/4)", "eta": "3/1000", "beta": "1/2", "gamma": "1",
         "App. L step": "(2009/8000, 2009/8000)", "Eq. (12) step": "(4009/16000, 4009/16000)"},
    )],
    "app-l-diagonal-mib-text": [("9/200 = 47/1000", {"layers": "23", "heads": "8", "d_k": "128", "MiB": "23/512"})],
    "momentum-writes-contract": [
        ("9/4 < 1", {"alpha": "1", "beta": "1/2", "eta": "1", "mu": "1/2", "S": "0", "M": "-4", "k": "1", "v": "-1"}),
    ],
    "rwkv7-writes-contract": [("4 < 1", {"S": "0", "kappa": "1", "alpha": "1/2", "k": "-1", "v": "1", "w": "0"})],
    "d4-h-zero-extension-continuous": [("-3/8 = 0", {"S": "0", "k": "1", "beta": "1/2", "d": "1", "a": "1/2"})],
    "app-b-vs-listing-1-normaliser": [
        (
            "501/2000 = 201/800",
            {
                "k": "(1, 1)", "d": "(1/4, 1/4)", "eta": "3/1000", "rho": "999/1000",
                "App. B step": "(201/800, 201/800)", "Listing 1 step": "(501/2000, 501/2000)",
            },
        ),
    ],
    "app-l-state-overhead": [
        ("1/128 <= 1/2000", {"state_MiB": "6", "d_MiB": "3/64"}),
        ("1/128 <= 1/2000", {"state_MiB": "12", "d_MiB": "3/32"}),
        ("1/256 <= 1/2000", {"state_MiB": "63/8", "d_MiB": "63/2048"}),
        ("1/128 <= 1/2000", {"state_MiB": "23/4", "d_MiB": "23/512"}),
        ("47/6000 <= 1/2000", {"before_MiB": "6", "after_MiB": "6047/1000"}),
        ("31/7875 <= 1/2000", {"before_MiB": "63/8", "after_MiB": "3953/500"}),
        ("9/1150 <= 1/2000", {"before_MiB": "23/4", "after_MiB": "1159/200"}),
        ("47/6000 <= 1/2000", {"before_MiB": "12", "after_MiB": "6047/500"}),
    ],
}


def _flat(records: list[dict], where: str = ""):
    """Every piece of evidence, conditionals' parts included (their kind prefixed "under"/"without")."""
    for record in records:
        yield where + record["kind"], record
        if record["kind"] == "conditional":
            yield from _flat(record["under"], "under ")
            yield from _flat(record["without"], "without ")


@pytest.fixture
def claims(ledger_json) -> dict[str, dict]:
    return {record["id"]: record for record in ledger_json["claims"]}


def test_every_claim_is_pinned():
    assert set(COVERED) == {c.id for c in ledger.CLAIMS}


@pytest.mark.parametrize("claim_id", list(COVERED))
def test_sizes_each_proof_covered(claims, claim_id):
    covered = [
        (kind, record.get("sizes", {}), record.get("steps"))
        for kind, record in _flat(claims[claim_id]["evidence"])
    ]
    assert covered == COVERED[claim_id]
    assert all(record["established"] for _, record in _flat(claims[claim_id]["evidence"]))


@pytest.mark.parametrize("claim_id", list(COUNTEREXAMPLES))
def test_counterexamples_record_their_numbers(claims, claim_id):
    found = [
        (record["relation"], record["instance"])
        for kind, record in _flat(claims[claim_id]["evidence"])
        if kind.endswith("counterexample")
    ]
    assert found == COUNTEREXAMPLES[claim_id]
    for kind, record in _flat(claims[claim_id]["evidence"]):
        if kind.endswith("counterexample"):
            assert record["holds"] is False and record["established"] is True


def _status_from_records(records: list[dict]) -> tuple[str, str | None]:
    """The derivation rule, re-implemented on the JSON alone."""
    if not records or not all(r["established"] for r in records):
        return "failed", None
    kinds = [r["kind"] for r in records]
    if "counterexample" in kinds:
        return "refuted", None
    conditions = [r["condition"] for r in records if r["kind"] == "conditional"]
    if conditions:
        return "conditional", "; ".join(conditions)
    return "verified", None


def test_recorded_status_follows_from_recorded_evidence(ledger_json):
    for record in ledger_json["claims"]:
        assert (record["status"], record["condition"]) == _status_from_records(record["evidence"]), record["id"]
        if any(e["kind"] == "counterexample" for e in record["evidence"]):
            assert record["status"] == "refuted", record["id"]


# --- the prose names the recorded sizes ---------------------------------------------------------------

_VALUE = r"\{(?P<set>\d+(?:,\s*\d+)*)\}|(?P<lo>\d+)\.\.(?P<hi>\d+)|(?P<one>\d+)(?![\d/]|\.\d)"


def size_mentions(text: str, names: set[str]) -> list[tuple[str, frozenset[int]]]:
    """``(name, values)`` for every "NAME = 3", "NAME = 1..4", "NAME ∈ {2, 3}" or "K = V = 1" in text."""
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    if not alternatives:
        return []
    chain = rf"(?:(?<![\w/^])(?:{alternatives})\s*=\s*)*"
    pattern = re.compile(rf"(?<![\w/^])(?P<name>{alternatives})\s*(?:=|∈)\s*{chain}(?:{_VALUE})")
    found = []
    for match in pattern.finditer(text):
        if match["set"]:
            values = frozenset(int(v) for v in match["set"].split(","))
        elif match["lo"]:
            values = frozenset(range(int(match["lo"]), int(match["hi"]) + 1))
        else:
            values = frozenset({int(match["one"])})
        # every name of a chain such as "K = V = 1" gets the value
        for name in re.findall(rf"(?<![\w/^])({alternatives})\s*(?:=|∈)", match.group(0)):
            found.append((name, values))
    return found


def test_size_mentions_parser():
    names = {"K", "V", "T", "C", "t", "d_k"}
    text = (
        "for K = 1..4, V ∈ {1, 2}; K = V = 1 and T = 2 (d_k = 128, β = 1/2, k_t = 3, K = d_k, 0^T = 0, "
        "K = 0.5, C = 2..4, V = 1."
    )
    assert size_mentions(text, names) == [
        ("K", frozenset({1, 2, 3, 4})),
        ("V", frozenset({1, 2})),
        ("K", frozenset({1})),
        ("V", frozenset({1})),
        ("T", frozenset({2})),
        ("d_k", frozenset({128})),
        ("C", frozenset({2, 3, 4})),
        ("V", frozenset({1})),
    ]


@pytest.mark.parametrize("claim", ledger.CLAIMS, ids=lambda c: c.id)
def test_text_names_the_recorded_sizes(claims, claim):
    record = claims[claim.id]
    pieces = [r for _, r in _flat(record["evidence"]) if r.get("sizes")]
    options: dict[str, set[frozenset[int]]] = {}
    for piece in pieces:
        for name, values in piece["sizes"].items():
            options.setdefault(name, set()).add(frozenset(values))
    for name in options:  # the union over the pieces, as in "T = 1..4" over four counterexamples
        options[name].add(frozenset().union(*options[name]))
    texts = [record["statement"], record["method"], record["detail"], record["condition"] or ""]
    mentions = [m for text in texts for m in size_mentions(text, set(options))]
    for name, values in mentions:
        assert values in options[name], f"text says {name} = {sorted(values)}; recorded {options[name]}"
    mentioned = {name for name, _ in mentions}
    for kind, piece in _flat(record["evidence"]):
        if kind.endswith("derivation"):
            missing = set(piece["sizes"]) - mentioned
            assert not missing, f"{piece['label']}: the text never names {sorted(missing)}"


# --- the verdicts that are not "verified", with their reasons ------------------------------------------

#: per claim that is not verified: (status, condition, the relations its counterexamples evaluate false,
#: those nested in a conditional's "without" included). Written from the ledger as reviewed: a refuted
#: claim turned into a verified one — its counterexamples recast, its expected status changed with them —
#: or a conditional whose hypothesis is dropped fails here. Every other claim must be verified.
VERDICTS = {
    "app-a5-apf-proximal-form": ("conditional", "‖k_t‖² ≥ ε, so that max(‖k_t‖², ε) = ‖k_t‖²",
                                 ["64023999997/64000000000 = 16023999997/16000000000"]),
    "thm-d7-zero-residual-convention": ("refuted", None, ["1 <= 0"] * 8),
    "thm-5.2-super-geometric": ("conditional", "u_t ≠ 0 at every token", ["oo <= 0"]),
    "d4-h-zero-extension-continuous": ("refuted", None, ["-3/8 = 0"]),
    "chunk-output-listing-2": ("conditional", "every cumulative decay of the chunk ≥ 10⁻⁶ (the listing's "
                               "clamp_min(1e-6) inactive)", ["20000019/400000000 = 20000001/40000000"]),
    "chunk-output-app-b2": ("conditional", "every cumulative decay of the chunk ≥ 10⁻⁶ (the listing's "
                            "clamp_min(1e-6) inactive)", ["20000019/400000000 = 20000001/40000000"]),
    "app-c-osgdn-fixed-point": ("conditional", "no preconditioner retention (ρ_t^d = 1) and a gated Newton point "
                                "inside the box [d_min, d_max]^K", ["3/7 = 1", "1/2 = 1"]),
    "app-b-vs-listing-1-normaliser": ("conditional", "unit keys (‖k_t‖² = 1, so max(‖k_t‖², ε) = 1)",
                                      ["501/2000 = 201/800"]),
    "app-l-vs-eq-12-normaliser": ("conditional", "unit keys (‖k_t‖² = 1, so max(‖k_t‖², ε) = 1)",
                                  ["4009/16000 = 2009/8000"]),
    "app-l-state-overhead": ("refuted", None, [
        "1/128 <= 1/2000", "1/128 <= 1/2000", "1/256 <= 1/2000", "1/128 <= 1/2000",
        "47/6000 <= 1/2000", "31/7875 <= 1/2000", "9/1150 <= 1/2000", "47/6000 <= 1/2000",
    ]),
    "app-l-diagonal-mib-text": ("refuted", None, ["9/200 = 47/1000"]),
    "diagnostic-measurement-count": ("conditional", "the 48 prompts average 851.2–852.3 tokens (the paper gives "
                                     "no prompt lengths)", ["11024368 <= 5000"]),
    "momentum-writes-contract": ("refuted", None, ["9/4 < 1"]),
    "rwkv7-writes-contract": ("refuted", None, ["4 < 1"]),
}


def _counter_relations(evidence: list[dict]) -> list[str]:
    out = []
    for piece in evidence:
        if piece["kind"] == "counterexample":
            out.append(piece["relation"])
        elif piece["kind"] == "conditional":
            out += [w["relation"] for w in piece["without"]]
    return out


def test_verdicts_and_their_reasons(claims):
    for claim_id, record in claims.items():
        expected = VERDICTS.get(claim_id, ("verified", None, []))
        got = (record["status"], record["condition"], _counter_relations(record["evidence"]))
        assert got == expected, claim_id
        assert record["expected"] == expected[0], claim_id
