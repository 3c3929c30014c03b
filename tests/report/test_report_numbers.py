"""Every number summary.json and report.md state about residual ratios, recomputed here from
residuals.parquet alone (pyarrow + numpy, no accumulator of the package), on two real runs: the built-in
DeltaNet on ``mqar-pair`` (two tasks, a repeated context) and a random Gated DeltaNet (``post_decay``),
and on the report comparing the two (one table per kernel family, each layer's family read from the
manifest).

Definitions (docs/metrics.md): ``q_geo = exp(mean log max(q, 1e-30))``, ``q_arith = mean q``, rows
with ``finite = false`` are left out, and a token's position bin is ``floor(10 · pos / length)`` of its
own sequence (computed here in integers). The package sums fp32 ratios in fp64 and so does this file
(``math.fsum``, exact), so the two agree to rounding of fp64 sums: 1e-9 relative.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import numpy as np
import pyarrow.parquet as pq
import pytest

from osdn_diag.cli import main
from _markdown import table_after as _table_after

REL = 1e-9
FLOOR = 1e-30
NUM_BINS = 10


# ---------------------------------------------------------------------------------------------- runs

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report_numbers")
    specs = {
        "deltanet": ["builtin:mqar-deltanet", "--num-prompts", "4", "--length", "64"],
        # The same prompts as above, so that the two runs can be compared in one report.
        "gated": ["random:gated-deltanet-tiny", "--num-prompts", "4", "--length", "64"],
        # A randomly initialised DeltaNet: what q_geo a newcomer should expect (the report's guide).
        "random": ["random:deltanet-tiny", "--num-prompts", "4", "--length", "64"],
    }
    out = {}
    for name, (model, *rest) in specs.items():
        run_dir = root / name
        assert main(["run", model, "--prompts", "mqar-pair", *rest, "--out", str(run_dir), "-q"]) == 0
        out[name] = _load(run_dir)
    return out


def _load(run_dir):
    table = pq.read_table(run_dir / "residuals.parquet")
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
    cols["task"] = np.asarray(table.column("task").to_pylist(), dtype=object)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    report = (run_dir / "report.md").read_text()
    return {"cols": cols, "manifest": manifest, "summary": summary, "report": report,
            "label": manifest["model"]["spec"], "dir": run_dir}


# ------------------------------------------------------------------------- independent computation

def _stats(q: np.ndarray) -> dict | None:
    """n, n_zero, q_geo, q_arith of fp64 ratios; None over nothing."""
    n = int(q.size)
    if n == 0:
        return None
    return {
        "n": n,
        "n_zero": int((q == 0).sum()),
        "q_geo": math.exp(math.fsum(np.log(np.maximum(q, FLOOR)).tolist()) / n),
        "q_arith": math.fsum(q.tolist()) / n,
    }


def _bins(q: np.ndarray, bins: np.ndarray) -> dict:
    per = [_stats(q[bins == b]) for b in range(NUM_BINS)]
    return {
        "q_geo": [None if s is None else s["q_geo"] for s in per],
        "q_arith": [None if s is None else s["q_arith"] for s in per],
        "n": [0 if s is None else s["n"] for s in per],
    }


def _expected(run, column: str) -> dict:
    c = run["cols"]
    keep = c["finite"].astype(bool)
    q = c[column].astype(np.float64)[keep]
    layer, head, task, pos, prompt = (c[k][keep] for k in ("layer", "head", "task", "pos", "prompt"))
    lengths = {p["id"]: int(p["length"]) for p in run["manifest"]["prompts"]}
    length = np.asarray([lengths[int(p)] for p in prompt], dtype=np.int64)
    bins = (pos.astype(np.int64) * NUM_BINS) // length
    exp = dict(_stats(q))
    exp["by_layer"] = {f"{int(v):03d}": _stats(q[layer == v]) for v in np.unique(layer)}
    exp["by_head"] = {f"{int(a):03d}.{int(b):03d}": _stats(q[(layer == a) & (head == b)])
                      for a, b in sorted({(int(a), int(b)) for a, b in zip(layer, head)})}
    family_of = {int(entry["layer"]): entry["family"] for entry in run["manifest"]["layers"]}
    family = np.asarray([family_of[int(v)] for v in layer], dtype=object)
    exp["by_family"] = {f: _stats(q[family == f]) for f in sorted(set(family))}
    tasks = sorted(set(task))
    exp["by_task"] = {t: _stats(q[task == t]) for t in tasks}
    exp["position_bins"] = {**_bins(q, bins), "by_task": {t: _bins(q[task == t], bins[task == t]) for t in tasks}}
    exp["excluded_nonfinite"] = int((~c["finite"].astype(bool)).sum())
    return exp


def _repeat_boundary(run) -> dict:
    acc = defaultdict(list)
    for p in run["manifest"]["prompts"]:
        if p["repeat_start"] >= 0:
            acc[p["task"]].append(p["repeat_start"] / p["length"])
    return {t: math.fsum(v) / len(v) for t, v in sorted(acc.items())}


# ----------------------------------------------------------------------------------------- checks

def _same_stats(got: dict, exp: dict, where: str) -> None:
    assert got["n"] == exp["n"], where
    assert got["n_zero"] == exp["n_zero"], where
    assert got["q_geo"] == pytest.approx(exp["q_geo"], rel=REL, abs=0), where
    assert got["q_arith"] == pytest.approx(exp["q_arith"], rel=REL, abs=0), where


def _same_bins(got: dict, exp: dict, where: str) -> None:
    assert got["n"] == exp["n"], where
    for stat in ("q_geo", "q_arith"):
        for b, (g, e) in enumerate(zip(got[stat], exp[stat], strict=True)):
            if e is None:
                assert g is None, f"{where} {stat} bin {b}"
            else:
                assert g == pytest.approx(e, rel=REL, abs=0), f"{where} {stat} bin {b}"


def _check_summary(got: dict, exp: dict, what: str) -> None:
    _same_stats(got, exp, f"{what} overall")
    for group in ("by_layer", "by_head", "by_task", "by_family"):
        assert set(got[group]) == set(exp[group]), f"{what} {group}"
        for key, e in exp[group].items():
            _same_stats(got[group][key], e, f"{what} {group}[{key}]")
    bins = got["position_bins"]
    assert bins["edges"] == pytest.approx([i / NUM_BINS for i in range(NUM_BINS + 1)], abs=1e-15)
    _same_bins(bins, exp["position_bins"], f"{what} position bins")
    assert set(bins["by_task"]) == set(exp["position_bins"]["by_task"]), what
    for t, e in exp["position_bins"]["by_task"].items():
        _same_bins(bins["by_task"][t], e, f"{what} position bins[{t}]")
    assert got["excluded_nonfinite"] == exp["excluded_nonfinite"], what


def _printed(cell: str, reported, expected) -> None:
    """A table cell is the summary's value to 3 decimals, and that is the recomputed value's too."""
    if expected is None:
        assert reported is None and cell == "–"
        return
    assert cell == f"{reported:.3f}" == f"{expected:.3f}", (cell, reported, expected)


def _check_contraction_table(header, rows, label, summary, exp) -> None:
    tasks = sorted(exp["by_task"])
    assert header == ["model", "q_geo ↓", "q_arith ↓", *[f"{t} q_geo ↓" for t in tasks], "n"]
    assert len(rows) == 1 and rows[0][0] == label
    row = rows[0]
    _printed(row[1], summary["q_geo"], exp["q_geo"])
    _printed(row[2], summary["q_arith"], exp["q_arith"])
    for i, t in enumerate(tasks):
        _printed(row[3 + i], summary["by_task"][t]["q_geo"], exp["by_task"][t]["q_geo"])
    assert row[-1] == f"{exp['n']:,}"


# ------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("name", ["deltanet", "gated"])
def test_residual_table_is_the_contract(runs, name):
    """The columns the recomputation relies on: every stream present once, rel_pos = pos / length."""
    run = runs[name]
    c = run["cols"]
    lengths = {p["id"]: int(p["length"]) for p in run["manifest"]["prompts"]}
    layers = len(run["manifest"]["layers"])
    heads = {layer["heads"] for layer in run["manifest"]["layers"]}
    assert len(heads) == 1
    assert c["pos"].size == sum(lengths.values()) * layers * heads.pop()
    length = np.asarray([lengths[int(p)] for p in c["prompt"]], dtype=np.float64)
    np.testing.assert_allclose(c["rel_pos"], c["pos"] / length, rtol=1e-7, atol=0)
    assert set(c["task"]) == {"mqar", "mqar-twice"}  # two tasks, one of them repeated


@pytest.mark.parametrize("name", ["deltanet", "gated"])
def test_summary_numbers_are_those_of_the_table(runs, name):
    run = runs[name]
    exp = _expected(run, "residual_ratio")
    _check_summary(run["summary"], exp, name)
    assert run["summary"]["position_bins"]["repeat_boundary"] == pytest.approx(_repeat_boundary(run), rel=REL)


@pytest.mark.parametrize("name", ["deltanet", "gated"])
def test_bins_are_geometric_means(runs, name):
    """The data can tell a geometric from an arithmetic mean in every bin (so the check above would
    catch a bin reporting the wrong one), and the summary's bin q_geo is not its q_arith."""
    exp = _expected(runs[name], "residual_ratio")["position_bins"]
    got = runs[name]["summary"]["position_bins"]
    for per_exp, per_got in [(exp, got), *((exp["by_task"][t], got["by_task"][t]) for t in exp["by_task"])]:
        for geo, arith, g in zip(per_exp["q_geo"], per_exp["q_arith"], per_got["q_geo"], strict=True):
            if geo is None:
                continue
            assert arith > geo * (1 + 1e-6)  # AM > GM strictly on these ratios
            assert g != pytest.approx(arith, rel=1e-6)


def test_post_decay_numbers(runs):
    run = runs["gated"]
    assert "residual_ratio_post" in run["cols"]
    exp = _expected(run, "residual_ratio_post")
    _check_summary(run["summary"]["post_decay"], exp, "post_decay")
    # The post-decay ratio is another column than the pre-decay one, and distinguishably so.
    pre = _expected(run, "residual_ratio")
    assert exp["q_geo"] != pytest.approx(pre["q_geo"], rel=1e-7)
    # Not gated: no post-decay statistics, no section.
    assert "post_decay" not in runs["deltanet"]["summary"]
    assert "## Gated layers: post-decay ratio" not in runs["deltanet"]["report"]


@pytest.mark.parametrize("name", ["deltanet", "gated"])
def test_report_tables_print_those_numbers(runs, name):
    run = runs[name]
    report, summary, label = run["report"], run["summary"], run["label"]
    exp = _expected(run, "residual_ratio")

    header, rows = _table_after(report, "Residual contraction (the paper's Table 8 layout)")
    _check_contraction_table(header, rows, label, summary, exp)

    header, rows = _table_after(report, "By relative position (Fig. 2a)")
    assert header == ["model", *[f"[{b / 10:.1f}, {(b + 1) / 10:.1f})" for b in range(NUM_BINS)]]
    assert len(rows) == 1 and rows[0][0] == label
    for b, cell in enumerate(rows[0][1:]):
        _printed(cell, summary["position_bins"]["q_geo"][b], exp["position_bins"]["q_geo"][b])
    boundary = _repeat_boundary(run)
    assert ("The repeated context starts at relative position "
            + ", ".join(f"{v:.2f} ({t})" for t, v in boundary.items()) + ".") in report

    header, rows = _table_after(report, "By layer and head")
    assert header == ["layer", label]
    assert [r[0] for r in rows] == [str(int(k)) for k in sorted(exp["by_layer"])]
    for row in rows:
        key = f"{int(row[0]):03d}"
        _printed(row[1], summary["by_layer"][key]["q_geo"], exp["by_layer"][key]["q_geo"])

    if name == "gated":
        exp_post = _expected(run, "residual_ratio_post")
        header, rows = _table_after(report, "Gated layers: post-decay ratio")
        _check_contraction_table(header, rows, label, summary["post_decay"], exp_post)



def test_family_tables_of_a_comparison(runs, tmp_path):
    """``report RUN_A RUN_B``: one table per kernel family, each row the recomputed statistics of that
    run's layers of the family (and the post-decay q_geo for the gated one)."""
    out = tmp_path / "compare"
    dirs = [str(runs[name]["dir"]) for name in ("deltanet", "gated")]
    assert main(["report", *dirs, "--out", str(out), "--labels", "dn", "gdn"]) == 0
    report = (out / "report.md").read_text()
    expected = {"delta_rule": ("dn", runs["deltanet"]), "gated_delta_rule": ("gdn", runs["gated"])}
    section = report[report.index("## By family"):]
    for family, (label, run) in expected.items():
        header, rows = _table_after(section, f"### {family}")
        assert header == ["model", "layers", "q_geo ↓", "q_arith ↓", "post-decay q_geo ↓", "n"]
        assert len(rows) == 1 and rows[0][0] == label, rows
        exp = _expected(run, "residual_ratio")["by_family"][family]
        got = run["summary"]["by_family"][family]
        assert rows[0][1] == str(len(run["manifest"]["layers"]))
        _printed(rows[0][2], got["q_geo"], exp["q_geo"])
        _printed(rows[0][3], got["q_arith"], exp["q_arith"])
        assert rows[0][5] == f"{exp['n']:,}"
        if family == "gated_delta_rule":
            post = _expected(run, "residual_ratio_post")["by_family"][family]
            _printed(rows[0][4], run["summary"]["post_decay"]["by_family"][family]["q_geo"], post["q_geo"])
        else:
            assert rows[0][4] == "–"
    # A single run of a single family has no such section.
    assert "## By family" not in runs["deltanet"]["report"]


@pytest.mark.parametrize("name", ["deltanet", "gated"])
def test_recall_numbers_are_those_of_the_manifest(runs, name):
    """summary.json -> recall and the report's recall table, recomputed from the manifest's per-prompt
    counts: accuracy = Σ correct / Σ queries, nll = Σ recall_nll / Σ queries (nats per query),
    perplexity = exp(nll); MQAR prompts are recall prompts, so there is no held-out text table. (Each
    prompt's recall_nll against cross_entropy: tests/pipeline/test_recall.py, tests/report/test_text_report.py.)"""
    run = runs[name]
    per_task = defaultdict(lambda: [0, 0, 0, [], 0])
    for p in run["manifest"]["prompts"]:
        acc = per_task[p["task"]]
        acc[0] += p["recall_correct"]
        acc[1] += p["recall_queries"]
        acc[2] += p.get("recall_excluded", 0)
        acc[3].append(p["recall_nll"])
        acc[4] += 1
    got = run["summary"]["recall"]
    assert set(got) == set(per_task) == {"mqar", "mqar-twice"}
    for task, (correct, queries, excluded, nlls, prompts) in per_task.items():
        nll = math.fsum(nlls) / queries
        assert (got[task]["correct"], got[task]["queries"], got[task]["excluded_nonfinite"], got[task]["prompts"]) \
            == (correct, queries, excluded, prompts)
        assert got[task]["accuracy"] == pytest.approx(correct / queries, rel=REL, abs=0)
        assert got[task]["nll"] == pytest.approx(nll, rel=REL, abs=0) and nll > 0
        assert got[task]["perplexity"] == pytest.approx(math.exp(nll), rel=REL, abs=0)
        assert got[task]["scoring"] == "recall"
    header, rows = _table_after(run["report"], "Recall accuracy (the paper's Table 7 layout)")
    assert header == ["model", "mqar accuracy ↑", "mqar-twice accuracy ↑", "queries"]
    (row,) = rows
    assert row[0] == run["label"]
    for cell, task in zip(row[1:3], ("mqar", "mqar-twice")):
        correct, queries = per_task[task][:2]
        _printed(cell, got[task]["accuracy"], correct / queries)
    assert row[3] == f"{sum(v[1] for v in per_task.values()):,}"
    assert "## Held-out text" not in run["report"]


# ---------------------------------------------------------------------------- comparator aggregates

NEWTON_TOL = 1e-9  # docs/metrics.md: the Newton system counts as solved at eps <= 1e-9


def _comparator(run):
    table = pq.read_table(run["dir"] / "comparator.parquet")
    return {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}


@pytest.mark.parametrize("name", ["deltanet", "gated"])
def test_comparator_numbers_are_those_of_comparator_parquet(runs, name):
    """summary.json -> comparator and the report's Theorem D.7 table, recomputed from comparator.parquet
    (means over streams with a valid token, the Theorem D.7 check over the streams whose hypotheses
    hold), and the Newton-feasibility flags from the table's own gaps."""
    run = runs[name]
    c = _comparator(run)
    got = run["summary"]["comparator"]
    has = c["n_valid"] > 0
    hold = c["hypotheses_hold"].astype(bool)
    assert has.any()

    def mean(x, sel):
        x = np.asarray(x, dtype=np.float64)[sel]
        return math.fsum(x) / x.size if x.size else None

    np.testing.assert_array_equal(c["newton_feasible"], has & (c["eps_free"] <= NEWTON_TOL))
    np.testing.assert_array_equal(c["newton_feasible_box"], has & (c["eps_diag"] <= NEWTON_TOL))
    # The box is a restriction: a system solvable in it is solvable in R^K, and its gap is no smaller.
    assert not (c["newton_feasible_box"] & ~c["newton_feasible"]).any()
    assert (c["eps_free"][has] <= c["eps_diag"][has] + 1e-12).all()
    expected = {
        "problems": len(hold),
        "eps_diag_mean": mean(c["eps_diag"], has),
        "eps_diag_median": float(np.median(c["eps_diag"][has])),
        "eps_at_ones_mean": mean(c["eps_at_ones"], has),
        "eps_at_final_d_mean": mean(c["eps_at_final_d"], has),
        "regret_mean": mean(c["regret"], has),
        "share_newton_infeasible_mean": mean(c["share_newton_infeasible"], has),
        "share_newton_feasible": mean(c["newton_feasible"], has),
        "share_newton_feasible_box": mean(c["newton_feasible_box"], has),
        "max_kkt_residual": float(c["kkt_residual"].max()),
        "max_gap": float(c["gap"].max()),
        "hypotheses_hold": int(hold.sum()),
        "bound_holds": int((c["slack"][hold] >= -1e-6).sum()),
        "slack_min": float(c["slack"][hold].min()) if hold.any() else None,
        "slack_mean": mean(c["slack"], hold),
    }
    for key, value in expected.items():
        if value is None or isinstance(value, int):
            assert got[key] == value, key
        else:
            assert got[key] == pytest.approx(value, rel=REL, abs=1e-15), key

    header, rows = _table_after(run["report"], "Comparator gap and Theorem D.7")
    assert header[:8] == ["model", "streams", "ε_T^diag (mean)", "ε_T(1)", "ε_T(d_T)", "regret R_T(d*)",
                          "β < 1/d_max", "Newton feasible (R^K / box)"]
    (row,) = rows
    assert row[1] == str(expected["problems"])
    assert row[2] == f"{expected['eps_diag_mean']:.4f}" and row[3] == f"{expected['eps_at_ones_mean']:.4f}"
    assert row[4] == f"{expected['eps_at_final_d_mean']:.4f}" and row[5] == f"{expected['regret_mean']:.3f}"
    assert row[6] == f"{100 * expected['share_newton_infeasible_mean']:.1f} %"
    assert row[7] == (f"{100 * expected['share_newton_feasible']:.1f} % / "
                      f"{100 * expected['share_newton_feasible_box']:.1f} %")
    assert row[8] == f"{expected['hypotheses_hold']} / {expected['problems']}"


def _cells(table: str) -> list[list[str]]:
    rows = [[c.strip() for c in line.strip()[1:-1].split(" | ")] for line in table.splitlines()]
    return rows[:1] + rows[2:]


def test_audit_and_theorem_tables_print_each_statistic_in_its_unit():
    """The audit and Theorem D.7 tables cell by cell, from summary entries whose every number differs:
    shares as percentages, ranges as [min, max] of the statistic named, bounds that hold counted over
    the streams whose hypotheses hold, the failed hypotheses named."""
    from osdn_diag.report.markdown import _audit_table, _comparator_table

    none_failed = {"unit_keys": 0, "beta_in_open_unit_interval": 0, "d_in_box": 0, "no_decay": 0,
                   "has_valid_token": 0}
    audit = {"n": 10, "max_unit_dev": 2.5e-3, "keys_read_as": ["bf16"], "key_rounding_bound": 4e-3,
             "key_norm_tol": 5e-3, "beta_min": 0.125, "beta_max": 0.875, "d_min": 0.5, "d_max": 1.75,
             "share_zero_residual": 0.0125, "share_newton_infeasible": 0.375, "decay": False,
             "streams": 12, "hypotheses_hold": 7,
             "hypotheses_failed": {**none_failed, "unit_keys": 3, "d_in_box": 4, "has_valid_token": 1}}
    decayed = {**audit, "decay": True, "hypotheses_hold": 0, "hypotheses_failed": {**none_failed, "no_decay": 12}}
    clean = {**audit, "hypotheses_hold": 12, "hypotheses_failed": none_failed}
    header, row, row2, row3 = _cells(_audit_table([("A", None, {"assumptions": audit}),
                                                   ("B", None, {"assumptions": decayed}),
                                                   ("C", None, {"assumptions": clean})]))
    assert dict(zip(header, row)) == {
        "model": "A", "max abs(‖k‖² − 1)": "2.5e-03", "keys read as (unit within)": "bf16 (5.0e-03)",
        "β range": "[0.125, 0.875]", "d range": "[0.500, 1.750]", "zero residuals": "1.25 %",
        "β < 1/d_max": "37.5 %", "state decay": "no", "Thm D.7 hypotheses hold (streams)": "7 / 12",
        "failed (streams)": "keys not unit: 3, d outside the box: 4, no valid token: 1"}
    assert row2[-3:] == ["yes", "0 / 12", "state decays: 12"]
    assert row3[-2:] == ["12 / 12", "none"]
    # A summary written before the audit counted streams: no count is made up.
    old = {k: v for k, v in audit.items() if k not in ("streams", "hypotheses_hold", "hypotheses_failed")}
    assert _cells(_audit_table([("D", None, {"assumptions": old})]))[1][-2:] == ["–", "–"]

    c = {"problems": 8, "eps_diag_mean": 0.01234, "eps_at_ones_mean": 0.04321, "eps_at_final_d_mean": 0.02468,
         "regret_mean": -0.125, "share_newton_infeasible_mean": 0.0625, "share_newton_feasible": 0.75,
         "share_newton_feasible_box": 0.25, "hypotheses_hold": 5, "bound_holds": 4, "slack_min": -0.5}
    header, row = _cells(_comparator_table([("A", c)]))
    assert dict(zip(header, row)) == {
        "model": "A", "streams": "8", "ε_T^diag (mean)": "0.0123", "ε_T(1)": "0.0432", "ε_T(d_T)": "0.0247",
        "regret R_T(d*)": "-0.125", "β < 1/d_max": "6.2 %", "Newton feasible (R^K / box)": "75.0 % / 25.0 %",
        "hypotheses hold (streams)": "5 / 8", "bound holds": "4 / 5", "min slack": "-0.500"}
    header, row = _cells(_comparator_table([("A", {**c, "hypotheses_hold": 0, "bound_holds": 0})]))
    assert row[header.index("bound holds")] == "–"


# ----------------------------------------------------------------- Theorem D.7's hypotheses, per stream

BASE_TOL = 1e-3  # docs/metrics.md: unit within 1e-3 plus the rounding of the dtype the keys were read in
MANTISSA = {"bfloat16": 8, "float16": 11, "float32": 24, "float64": 53}  # u = 2^-p
CHECKS = ("unit_keys", "beta_in_open_unit_interval", "d_in_box", "no_decay", "has_valid_token")
WORDS = {"unit_keys": "keys not unit", "beta_in_open_unit_interval": "β outside (0, 1)",
         "d_in_box": "d outside the box", "no_decay": "state decays", "has_valid_token": "no valid token"}


def _stream_flags(run) -> dict[tuple[int, int, int], dict]:
    """Each (prompt, layer, head) stream's checks, from residuals.parquet and the manifest alone: valid
    tokens are finite with loss_before > 0 (--zero-residual drop), keys unit within 1e-3 + (1 + u)² − 1
    for the dtype the layer's kernel read them in, β in (0, 1) there, no decay; these runs record no d."""
    c = run["cols"]
    layers = {int(e["layer"]): e for e in run["manifest"]["layers"]}
    assert not any(e["has_d"] for e in layers.values())
    valid = c["finite"].astype(bool) & (c["loss_before"] > 0)
    keys = np.stack([c["prompt"], c["layer"], c["head"]], 1).astype(np.int64)
    flags = {}
    for key in sorted({tuple(int(x) for x in k) for k in keys}):
        rows = np.all(keys == key, axis=1) & valid
        entry = layers[key[1]]
        tol = BASE_TOL + ((1 + 2.0 ** -MANTISSA[entry["flags"]["qk_read_as"]]) ** 2 - 1)
        dev = np.abs(c["key_sqnorm"][rows].astype(np.float64) - 1)
        beta = c["beta"][rows].astype(np.float64)
        # The table's fp32 key norms can decide the check only away from the tolerance's edge.
        assert dev.size == 0 or abs(dev.max() - tol) > 1e-5, (key, dev.max(), tol)
        f = {"unit_keys": bool(np.all(dev <= tol)), "beta_in_open_unit_interval": bool(np.all((beta > 0) & (beta < 1))),
             "d_in_box": True, "no_decay": not entry["gated"], "has_valid_token": bool(rows.any()), "tol": tol}
        f["hypotheses_hold"] = all(f[name] for name in CHECKS)
        flags[key] = f
    return flags


def _counts(flags) -> dict:
    return {"streams": len(flags), "hypotheses_hold": sum(f["hypotheses_hold"] for f in flags),
            "hypotheses_failed": {name: sum(not f[name] for f in flags) for name in CHECKS}}


@pytest.mark.parametrize("name", ["deltanet", "gated", "random"])
def test_hypotheses_are_one_definition_counted_in_streams(runs, name):
    """comparator.parquet's checks per stream, summary.json's counts (assumption audit overall, per
    layer and head; comparator) and both report tables: the same streams, the same definition, equal
    to the recomputation from the per-token table."""
    run = runs[name]
    exp = _stream_flags(run)
    table = pq.read_table(run["dir"] / "comparator.parquet")
    c = {k: table.column(k).to_pylist() for k in table.column_names}
    got = {(p, layer, h): i for i, (p, layer, h) in enumerate(zip(c["prompt"], c["layer"], c["head"]))}
    assert set(got) == set(exp) and len(got) == table.num_rows
    for key, i in got.items():
        for col in ("unit_keys", "beta_in_open_unit_interval", "d_in_box", "no_decay", "hypotheses_hold"):
            assert c[col][i] == exp[key][col], (key, col)
        assert (c["n_valid"][i] > 0) == exp[key]["has_valid_token"], key
        assert c["key_norm_tol"][i] == pytest.approx(exp[key]["tol"], rel=1e-12, abs=0), key

    total = _counts(list(exp.values()))
    audit, comp = run["summary"]["assumptions"], run["summary"]["comparator"]
    assert {k: audit[k] for k in total} == total
    assert comp["problems"] == total["streams"]
    assert comp["hypotheses_hold"] == total["hypotheses_hold"]
    assert comp["hypotheses_failed"] == total["hypotheses_failed"]
    for layer in {k[1] for k in exp}:
        sub = _counts([f for k, f in exp.items() if k[1] == layer])
        assert {k: audit["by_layer"][f"{layer:03d}"][k] for k in sub} == sub
        for head in {k[2] for k in exp if k[1] == layer}:
            sub = _counts([f for k, f in exp.items() if k[1:] == (layer, head)])
            assert {k: audit["by_head"][f"{layer:03d}.{head:03d}"][k] for k in sub} == sub

    header, rows = _table_after(run["report"], "Assumption audit")
    (row,) = rows
    cells = dict(zip(header, row))
    hold = f"{total['hypotheses_hold']} / {total['streams']}"
    assert cells["Thm D.7 hypotheses hold (streams)"] == hold
    failed = [f"{WORDS[n]}: {total['hypotheses_failed'][n]}" for n in CHECKS if total["hypotheses_failed"][n]]
    assert cells["failed (streams)"] == (", ".join(failed) or "none")
    tols = {f["tol"] for f in exp.values()}
    assert len(tols) == 1 and cells["keys read as (unit within)"].endswith(f"({tols.pop():.1e})")
    header, rows = _table_after(run["report"], "Comparator gap and Theorem D.7")
    (row,) = rows
    assert dict(zip(header, row))["hypotheses hold (streams)"] == hold
    assert dict(zip(header, row))["streams"] == str(total["streams"])


def test_the_runs_cover_holding_and_each_kind_of_failing_stream(runs):
    """The check above is informative: the trained DeltaNet has streams that hold and streams whose
    keys are not unit (fp32 keys normalised with an eps), the gated model fails on decay alone."""
    dn = _counts(list(_stream_flags(runs["deltanet"]).values()))
    assert 0 < dn["hypotheses_hold"] < dn["streams"] and dn["hypotheses_failed"]["unit_keys"] > 0
    gated = _counts(list(_stream_flags(runs["gated"]).values()))
    assert gated["hypotheses_hold"] == 0 and gated["hypotheses_failed"]["no_decay"] == gated["streams"]


def test_the_q_geo_guide_is_what_the_runs_show(runs):
    """The report's guide: without decay q_t = (1 − a_t)² exactly at every valid token (for a gated
    layer, the post-decay ratio); at random initialisation β ≈ 0.5 and keys are unit, so q_geo ≈ 0.25."""
    from osdn_diag.report.markdown import EXPECTATION_NOTE

    for name, column in (("deltanet", "residual_ratio"), ("random", "residual_ratio"),
                         ("gated", "residual_ratio_post")):
        run = runs[name]
        assert EXPECTATION_NOTE in run["report"]
        c = run["cols"]
        valid = c["finite"].astype(bool) & (c["loss_before"] > 0)
        q, a = c[column][valid].astype(np.float64), c["write_gain"][valid].astype(np.float64)
        np.testing.assert_allclose(q, (1 - a) ** 2, rtol=1e-4, atol=1e-6, err_msg=name)
    c = runs["random"]["cols"]
    keep = c["finite"].astype(bool)
    beta, n2 = c["beta"][keep].astype(np.float64), c["key_sqnorm"][keep].astype(np.float64)
    assert abs(beta.mean() - 0.5) < 0.02 and np.all(np.abs(beta - 0.5) < 0.15)
    assert np.all(np.abs(n2 - 1) < 0.05)
    q_geo = _stats(c["residual_ratio"][keep].astype(np.float64))["q_geo"]
    assert runs["random"]["summary"]["q_geo"] == pytest.approx(q_geo, rel=REL)
    assert abs(q_geo - 0.25) < 0.01
    assert "(1 − 0.5)² = 0.25" in EXPECTATION_NOTE
