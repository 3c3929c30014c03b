"""Every number the view embeds, recomputed here from the run's files alone (pyarrow + numpy + the
stored capture read with safetensors; no accumulator of the package): the contraction curve, the
layer × head heat map, each head's curve, q_geo by layer, the token strips (q_t, losses, β and the
key-weighted d per token and layer), ε_T^diag against q_geo by layer, and the d trajectory.

Definitions (docs/metrics.md): ``q_geo = exp(mean log max(q, 1e-30))`` over rows with ``finite``; a
position's bin is ``floor(10 · pos / length)`` of its prompt. Aggregates are fp64 sums (1e-9 relative);
the strips are stored as float32 (1e-6 relative).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

import osdn_diag
from _page import page_data, page_figures

REL, REL32, FLOOR = 1e-9, 1e-6, 1e-30


def _arr(x):
    """A figure's array as plotly wrote it: a list, or a typed array (dtype + base64)."""
    if isinstance(x, dict) and "bdata" in x:
        import base64

        return np.frombuffer(base64.b64decode(x["bdata"]), dtype=np.dtype(x["dtype"])).tolist()
    return x


def _geo(q):
    q = np.asarray(q, dtype=np.float64)
    return None if q.size == 0 else math.exp(math.fsum(np.log(np.maximum(q, FLOOR)).tolist()) / q.size)


class Rows(dict):
    """Columns of a table as numpy arrays; ``rows[mask]`` the rows where ``mask`` holds."""

    def __getitem__(self, key):
        if isinstance(key, str):
            return dict.__getitem__(self, key)
        return Rows({k: v[key] for k, v in self.items()})

    def __len__(self):
        return len(next(iter(self.values())))


def _rows(path) -> Rows:
    t = pq.read_table(path)
    return Rows({c: (np.asarray(t.column(c).to_pylist(), dtype=object) if c == "task"
                     else t.column(c).to_numpy(zero_copy_only=False)) for c in t.column_names})


@pytest.fixture(scope="module")
def page(lm_run):
    html = osdn_diag.view(lm_run, strips=2).html
    t = _rows(lm_run / "residuals.parquet")
    t = t[t["finite"].astype(bool)]
    manifest = json.loads((lm_run / "manifest.json").read_text())
    length = {p["id"]: p["length"] for p in manifest["prompts"]}
    t["bin"] = np.minimum(10 * t["pos"].astype(np.int64) // np.array([length[p] for p in t["prompt"]]), 9)
    return {"html": html, "data": page_data(html), "figs": page_figures(html), "t": t, "manifest": manifest,
            "dir": lm_run}


def test_contraction_curve_per_task(page):
    t, fig = page["t"], page["figs"]["contraction"]
    tasks = sorted(set(t["task"]))
    assert len(tasks) == 2  # single and twice: a curve each
    for task in tasks:
        trace = next(tr for tr in fig["data"] if tr["name"].endswith(f"· {task}"))
        sub = t[t["task"] == task]
        want = [_geo(sub[sub["bin"] == b]["residual_ratio"]) for b in range(10)]
        assert _arr(trace["y"]) == pytest.approx(want, rel=REL)
        assert [c[0] for c in trace["customdata"]] == [int((sub["bin"] == b).sum()) for b in range(10)]


def test_heat_map_head_curves_and_by_layer(page):
    t, figs, data = page["t"], page["figs"], page["data"]
    heat = figs["layer-head"]["data"][0]
    for layer, head in sorted(set(zip(t["layer"].tolist(), t["head"].tolist()))):
        g = t[(t["layer"] == layer) & (t["head"] == head)]
        q, n = heat["customdata"][layer][head]
        assert q == pytest.approx(_geo(g["residual_ratio"]), rel=REL) and n == len(g)
        assert heat["z"][layer][head] == pytest.approx(math.log10(_geo(g["residual_ratio"])), rel=REL)
        curve = data["runs"][0]["head_curves"][f"{layer}.{head}"]
        want = [_geo(g[g["bin"] == b]["residual_ratio"]) for b in range(10)]
        assert curve["q_geo"] == pytest.approx(want, rel=REL)
        assert curve["n"] == [int((g["bin"] == b).sum()) for b in range(10)]
    bars = figs["by-layer"]["data"][0]
    want = [_geo(t[t["layer"] == layer]["residual_ratio"]) for layer in sorted(set(t["layer"].tolist()))]
    assert _arr(bars["y"]) == pytest.approx(want, rel=REL)
    first = figs["head-curve"]["data"][0]  # drawn for layer 0, head 0 until a cell is clicked
    assert _arr(first["y"]) == pytest.approx(data["runs"][0]["head_curves"]["0.0"]["q_geo"], rel=REL)


def test_token_strips(page):
    t, data, d = page["t"], page["data"], page["dir"]
    run = data["runs"][0]
    assert [s["id"] for s in run["strips"]] == [0, 1]  # one prompt of each task
    tokens = _rows(d / "tokens.parquet")
    t["d_key"] = t["write_gain"].astype(np.float64) / (t["beta"].astype(np.float64) * t["key_sqnorm"])
    for strip in run["strips"]:
        pid = strip["id"]
        mine = tokens[tokens["prompt"] == pid]
        assert strip["tokens"] == [mine["text"][i] for i in np.argsort(mine["pos"])]
        sub = t[t["prompt"] == pid]
        for row, layer in enumerate([*run["layers"], None]):
            cells = sub if layer is None else sub[sub["layer"] == layer]
            for pos in range(strip["length"]):
                c = cells[cells["pos"] == pos]
                got = {f: strip["v"][f][row, pos] for f in data["fields"]}
                assert got["q"] == pytest.approx(_geo(c["residual_ratio"]), rel=REL32)
                for f, col in (("loss_before", "loss_before"), ("loss_after", "loss_after"), ("beta", "beta"),
                               ("d_key", "d_key")):
                    want = math.fsum(c[col].astype(float).tolist()) / len(c)
                    assert got[f] == pytest.approx(want, rel=REL32, abs=1e-12), (f, pid, layer, pos)


def test_eps_vs_q_by_layer(page):
    c = _rows(page["dir"] / "comparator.parquet")
    c = c[c["n_valid"] > 0]
    trace = page["figs"]["eps-vs-q"]["data"][0]
    assert _arr(trace["x"]) == pytest.approx(c["eps_diag"].tolist(), rel=REL)
    assert _arr(trace["y"]) == pytest.approx(np.exp(c["log_prod_q"] / c["n_valid"]).tolist(), rel=REL)
    assert _arr(trace["marker"]["color"]) == c["layer"].tolist()


def test_d_trajectory_from_the_stored_capture(page):
    from safetensors import safe_open

    manifest = page["manifest"]
    layer = min(entry["layer"] for entry in manifest["layers"] if entry["has_d"])
    shard = sorted(s for s in manifest["shards"] if s.endswith(f"layer_{layer:03d}.safetensors"))[0]
    with safe_open(str(page["dir"] / shard), "np") as f:
        prompts = json.loads(f.metadata()["prompts"])
        d = f.get_tensor("d")[0, :, 0].astype(np.float64)  # first sequence, head 0: [T, K]
    trace = next(tr for tr in page["figs"]["d-trajectory"]["data"] if tr.get("mode") == "lines")
    assert f"layer {layer}, head 0, prompt {prompts[0]}" in trace["name"]
    assert _arr(trace["y"]) == pytest.approx(d.mean(1).tolist(), rel=1e-6)


def test_several_runs_share_axes_one_colour_each(lm_run):
    html = osdn_diag.view({"A": lm_run, "B": lm_run}, strip_prompts=[1]).html
    data, figs = page_data(html), page_figures(html)
    assert [r["label"] for r in data["runs"]] == ["A", "B"] and data["runs"][0]["colour"] != data["runs"][1]["colour"]
    assert [s["id"] for r in data["runs"] for s in r["strips"]] == [1, 1]
    assert len(figs["layer-head"]["data"]) == 2  # a heat map per run, one colour scale
    assert figs["layer-head"]["data"][0]["zmin"] == figs["layer-head"]["data"][1]["zmin"]
    lines = [tr["line"]["color"] for tr in figs["by-layer"]["data"] if "line" in tr] or \
            [tr["marker"]["color"] for tr in figs["by-layer"]["data"]]
    assert lines == [data["runs"][0]["colour"], data["runs"][1]["colour"]]
