"""The cross-family report's units, comparator rows and loss statement, every number recomputed from
the runs' residuals.parquet and comparator.parquet (pyarrow + numpy, nothing of the package).

Three small runs on the same prompts (``mqar-pair``, one pair of 32 tokens, the reference stand-in
on the CPU): a random Gated DeltaNet (one write per token), a random GatedDeltaProduct (two
micro-step writes per token, docs/families.md) and a random Comba (a loss of its own, read with
``p``; Theorem D.7's comparator does not apply to it). Definitions: ``q_geo = exp(mean log max(q,
1e-30))`` over finite rows (docs/metrics.md); the per-token statistic is that of ``token_ratio`` on the
``step = 0`` rows for GatedDeltaProduct (one row per token: the ratio of the token's loss over its
micro-steps' pairs) and of ``residual_ratio`` for every other family (docs/families.md,
run-directory.md).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from osdn_diag.cli import main
from _markdown import table_after as _table_after

REL = 1e-9
FLOOR = 1e-30
MICRO = 2  # random:gated-deltaproduct-tiny's micro-steps per token
SPECS = {"gdn": "random:gated-deltanet-tiny", "gdp": "random:gated-deltaproduct-tiny", "comba": "random:comba-tiny"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report_units")
    out = {}
    for name, model in SPECS.items():
        run_dir = root / name
        assert main(["run", model, "--prompts", "mqar-pair", "--num-prompts", "1", "--length", "32",
                     "--out", str(run_dir), "-q"]) == 0
        table = pq.read_table(run_dir / "residuals.parquet")
        out[name] = {
            "dir": run_dir,
            "cols": {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names},
            "summary": json.loads((run_dir / "summary.json").read_text()),
            "report": (run_dir / "report.md").read_text(),
        }
    return out


@pytest.fixture(scope="module")
def compared(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "report"
    assert main(["report", *[str(runs[n]["dir"]) for n in SPECS], "--out", str(out), "--labels", *SPECS]) == 0
    return (out / "report.md").read_text()


def _geo(q: np.ndarray) -> float:
    return math.exp(math.fsum(np.log(np.maximum(q.astype(np.float64), FLOOR)).tolist()) / q.size)


def _per_token(run, post: bool = False) -> tuple[float, int]:
    """(q_geo per token, tokens) of a run (all its layers are of one family)."""
    c = run["cols"]
    keep = c["finite"].astype(bool)
    if "step" in c:  # a micro-step family (the only one whose table has the column): its step-0 rows
        keep &= c["step"] == 0
        q = c["token_ratio_post" if post else "token_ratio"][keep]
    else:
        q = c["residual_ratio_post" if post else "residual_ratio"][keep]
    return _geo(q), int(q.size)


def _per_write(run, post: bool = False) -> tuple[float, int]:
    c = run["cols"]
    q = c["residual_ratio_post" if post else "residual_ratio"][c["finite"].astype(bool)]
    return _geo(q), int(q.size)


def _fmt(x: float) -> str:
    """docs/families.md: ratios below 0.01 print with 3 significant digits, others with 3 decimals."""
    return f"{x:.3f}" if x >= 0.01 else f"{x:.2e}"


FAMILY = {"gdn": "gated_delta_rule", "gdp": "gated_delta_product", "comba": "comba"}


@pytest.mark.parametrize("name", list(SPECS))
def test_per_token_statistics_in_the_summary(runs, name):
    run = runs[name]
    s = run["summary"]
    for part, post in ((s, False), (s["post_decay"], True)):
        geo, tokens = _per_token(run, post)
        entry = part["by_family"][FAMILY[name]]
        for got in (part, entry):
            assert got["q_geo_per_token"] == pytest.approx(geo, rel=REL, abs=0), (name, post)
            assert got["n_tokens"] == tokens
        assert entry["unit"] == ("micro-step" if name == "gdp" else "token")
        geo_w, n_w = _per_write(run, post)
        assert entry["q_geo"] == pytest.approx(geo_w, rel=REL, abs=0) and entry["n"] == n_w
        if name == "gdp":
            # n micro-steps per token: q_geo^n is the mean of the products of the micro-step ratios
            # (no zero ratio here); the per-token statistic is of the token's own ratio, the one loss
            # L_t after over before the token (token_loss_after / token_loss_before(_decayed)).
            c = run["cols"]
            first = c["finite"].astype(bool) & (c["step"] == 0)
            prod = c["micro_step_ratio_product_post" if post else "micro_step_ratio_product"][first]
            assert n_w == MICRO * tokens and entry["n_zero"] == 0
            assert _geo(prod) == pytest.approx(geo_w ** MICRO, rel=1e-5)
            before = c["token_loss_before_decayed" if post else "token_loss_before"][first].astype(np.float64)
            ratio = c["token_loss_after"][first].astype(np.float64) / before
            q = c["token_ratio_post" if post else "token_ratio"][first].astype(np.float64)
            assert (before > 0).all() and np.allclose(q, ratio, rtol=1e-5, atol=0)
            # distinguishably not the per-write q_geo, nor the products' mean
            assert not 0.5 < geo / geo_w < 2 and not 0.5 < geo / _geo(prod) < 2
        else:
            assert tokens == n_w and geo == pytest.approx(geo_w, rel=REL)


def test_main_table_says_per_what_and_compares_per_token(compared, runs):
    header, rows = _table_after(compared, "## Residual contraction (the paper's Table 8 layout)")
    assert header == ["model", "writes", "q_geo ↓", "q_arith ↓", "mqar q_geo ↓", "mqar-twice q_geo ↓", "n",
                      "q_geo per token ↓", "tokens"]
    assert [r[0] for r in rows] == list(SPECS)
    for row in rows:
        run = runs[row[0]]
        assert row[1] == ("per micro-step (2 per token)" if row[0] == "gdp" else "per token")
        geo_w, n_w = _per_write(run)
        geo, tokens = _per_token(run)
        assert row[2] == _fmt(geo_w) and row[6] == f"{n_w:,}"
        assert row[7] == _fmt(geo) and row[8] == f"{tokens:,}"
    assert "`q_geo per token` is the geometric mean of each token's ratio" in compared
    assert "it is the column that compares across families" in compared
    # The post-decay table likewise.
    header, rows = _table_after(compared, "## Gated layers: post-decay ratio")
    assert header[1] == "writes" and header[-2:] == ["q_geo per token ↓", "tokens"]
    for row in rows:
        assert row[-2] == _fmt(_per_token(runs[row[0]], post=True)[0])
    # Where GatedDeltaProduct's per-write numbers stand beside the others', its label says so.
    for heading in ("## By relative position (Fig. 2a)", "## By layer and head"):
        header, rows = _table_after(compared, heading)
        assert "gdp (per micro-step)" in [*header, *(r[0] for r in rows)], heading
        assert "gdn (per micro-step)" not in [*header, *(r[0] for r in rows)], heading


def test_family_tables_carry_units_and_the_per_token_columns(compared, runs):
    section = compared[compared.index("## By family"):]
    for name, family in FAMILY.items():
        header, (row,) = _table_after(section, f"### {family}")
        assert header == ["model", "layers", "writes", "q_geo ↓", "q_arith ↓", "post-decay q_geo ↓", "n",
                          "q_geo per token ↓", "post-decay q_geo per token ↓", "tokens"]
        run = runs[name]
        assert row[0] == name and row[2] == ("per micro-step" if name == "gdp" else "per token")
        assert row[3] == _fmt(_per_write(run)[0]) and row[5] == _fmt(_per_write(run, True)[0])
        assert row[6] == f"{_per_write(run)[1]:,}"
        assert row[7] == _fmt(_per_token(run)[0]) and row[8] == _fmt(_per_token(run, True)[0])
        assert row[9] == f"{_per_token(run)[1]:,}"


def test_single_family_runs_keep_their_layout(runs):
    """One write per token and one run: no unit columns (every number is per token)."""
    header, _ = _table_after(runs["gdn"]["report"], "## Residual contraction (the paper's Table 8 layout)")
    assert header[1] == "q_geo ↓" and "q_geo per token ↓" not in header
    header, _ = _table_after(runs["gdp"]["report"], "## Residual contraction (the paper's Table 8 layout)")
    assert header[1] == "writes" and "q_geo per token ↓" in header


def test_comparator_table_leaves_out_families_the_theorem_does_not_describe(compared, runs):
    header, rows = _table_after(compared, "## Comparator gap and Theorem D.7")
    assert [r[0] for r in rows] == ["gdn", "gdp"]
    for row in rows:
        c = pq.read_table(runs[row[0]]["dir"] / "comparator.parquet").to_pydict()
        eps = [e for e, n in zip(c["eps_diag"], c["n_valid"]) if n]
        assert row[1] == str(len(c["eps_diag"])) and row[2] == f"{math.fsum(eps) / len(eps):.4f}"
    assert ("Not shown: comba (comba). Theorem D.7's comparator models a delta-rule write along d ⊙ k "
            "for the key the loss reads, which is not these families' write") in compared
    assert (runs["comba"]["dir"] / "comparator.parquet").is_file()  # the rows are still written
    # A Comba run's own report: no table, the note alone.
    own = runs["comba"]["report"]
    section = own[own.index("## Comparator gap and Theorem D.7"):]
    section = section[:section.find("\n## ", 1)]
    assert "Not shown: random:comba-tiny (comba)." in section and "| streams |" not in section


def test_preamble_states_each_familys_loss(compared, runs):
    first = compared.split("\n## ")[0]
    assert "with `f_t(S) = ½‖S k_t − v_t‖²`" not in first
    assert "Each family's loss is its own: comba: `½‖S p_t − v_t‖²`" in first
    assert "gated_delta_rule: `½‖S k_t − v_t‖²`" in first
    assert "gated_delta_product: each micro-step's `½‖S k_{t,j} − v_{t,j}‖²`" in first
    assert "the By family section below" in first and "docs/families.md" in first
    # A run of the plain form states it as before.
    assert "with `f_t(S) = ½‖S k_t − v_t‖²`" in runs["gdn"]["report"].split("\n## ")[0]
    assert "Each family's loss is its own" not in runs["gdn"]["report"]


def test_preamble_of_gdn2_and_rwkv7():
    from osdn_diag.report.markdown import _preamble

    def run(*families):
        return ("x", {"layers": [{"layer": i, "family": f} for i, f in enumerate(families)]}, {"by_family": {}})

    text = _preamble([run("gdn2"), run("rwkv7"), run("delta_rule")])
    assert "Each family's loss is its own: gdn2: `½‖S (b_t ⊙ k_t) − w_t ⊙ v_t‖²`" in text
    assert "rwkv7: `½‖S κ̂_t − v_t‖²`" in text and "delta_rule: `½‖S k_t − v_t‖²`" in text
    assert "with `f_t(S) = ½‖S k_t − v_t‖²`" not in text
