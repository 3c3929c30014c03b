"""The notebook plotting API (:mod:`osdn_diag.plot`) and :class:`osdn_diag.Results` from a run
directory: figures returned (not files), drawn from the numbers a test recomputes from the summary,
single and repeated context apart, integer layer ticks, the d plot's legend saying what its mean covers.

Runs are synthetic captures (no model): two layers, two heads, two tasks — ``once`` and ``twice``
(repeat from position 12) — with OSDN's d recorded so the d plot has something to draw.
"""

from __future__ import annotations

import json
import math

from pathlib import Path

import pytest
import torch

import osdn_diag
import osdn_diag.plot as odp
from osdn_diag.capture import CaptureWriter, KernelCall
from osdn_diag.math import osdn
from osdn_diag.pipeline import replay_run
from osdn_diag.report.plots import save

B, T, H, K, V = 1, 24, 2, 8, 8


def _call(layer: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    beta = torch.rand(B, T, H, generator=gen) * 0.4
    d = 0.5 + 1.5 * torch.rand(B, T, H, K, generator=gen)
    o = osdn(q, k, v, beta, d).o
    return KernelCall(layer=layer, layer_name=f"layers.{layer}", family="osdn", kernel="x", q=q, k=k, v=v,
                      beta=beta, d=d, o=o, scale=K**-0.5)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("plot") / "run"
    w = CaptureWriter(path)
    w.begin({"model": {"spec": "synthetic-osdn"}, "prompts_source": "test",
             "prompts": [{"id": 0, "task": "once", "length": T},
                         {"id": 1, "task": "twice", "length": T, "repeat_start": 12}]})
    for prompt in (0, 1):
        for layer in range(2):
            w.write(prompt, [prompt], _call(layer, 10 * prompt + layer))
    w.finish({"kernels": ["fla"]})
    replay_run(path, progress=False)
    return path


def _lines(fig):
    return [line for ax in fig.axes for line in ax.get_lines()]


def test_contraction_keeps_single_and_repeated_context_apart(run):
    summary = json.loads((run / "summary.json").read_text())
    fig = odp.contraction(run)
    curves = {line.get_label(): list(line.get_ydata()) for line in _lines(fig) if line.get_marker() == "o"}
    assert set(curves) == {"synthetic-osdn · once", "synthetic-osdn · twice"}
    for task in ("once", "twice"):
        want = summary["position_bins"]["by_task"][task]["q_geo"]
        assert curves[f"synthetic-osdn · {task}"] == pytest.approx([math.nan if x is None else x for x in want],
                                                                   nan_ok=True)
    # The repeat start is marked once, for the task that repeats, where that task's prompts repeat.
    marks = [line for line in _lines(fig) if line.get_marker() != "o"]
    assert len(marks) == 1 and marks[0].get_xdata()[0] == pytest.approx(12 / 24)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == [" twice: repeat starts"]


def test_results_from_memory_and_disk_plot_alike(run):
    loaded = osdn_diag.Results.load(run)
    assert loaded.table.num_rows == 2 * T * 2 * H
    text = repr(loaded)
    assert text.startswith(f"Results(q_geo={loaded.summary['q_geo']:.4g}, ") and "2 layers" in text
    assert f"{loaded.table.num_rows:,} rows" in text and len(text) < 400
    a = [list(line.get_ydata()) for line in _lines(odp.by_layer(run))]
    b = [list(line.get_ydata()) for line in _lines(odp.by_layer({"mine": loaded}))]
    assert a == b == [[loaded.summary["by_layer"][k]["q_geo"] for k in ("000", "001")]]


def test_by_layer_ticks_are_whole_layers(run):
    fig = odp.by_layer([run, run])
    ax = fig.axes[0]
    fig.canvas.draw() if hasattr(fig.canvas, "draw") else None
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_a_mapping_labels_its_runs(run):
    """``{label: run}``: each run is drawn under its label, a run directory included (the model spec
    labels a run only in a list)."""
    loaded = osdn_diag.Results.load(run)
    fig = odp.by_layer({"DeltaNet": run, "OSDN": loaded})
    assert [line.get_label() for line in _lines(fig)] == ["DeltaNet", "OSDN"]
    assert [line.get_label() for line in _lines(odp.by_layer([run]))] == ["synthetic-osdn"]
    # runs of one model spec are told apart (by directory name, else by number), in lists only
    assert [line.get_label() for line in _lines(odp.by_layer([run, run]))] == ["synthetic-osdn #1",
                                                                             "synthetic-osdn #2"]


def test_default_labels_that_coincide_are_told_apart():
    from osdn_diag.report.markdown import distinct_labels

    assert distinct_labels(["m", "m", "b"], [Path("x/seed0"), Path("y/seed1"), None]) == [
        "m (seed0)", "m (seed1)", "b"]
    assert distinct_labels(["m", "m"], [Path("x/r"), Path("y/r")]) == ["m #1", "m #2"]
    assert distinct_labels(["m", "m", "m"], [None, Path("q"), None]) == ["m #1", "m (q)", "m #2"]
    assert distinct_labels(["a", "b"], [None, None]) == ["a", "b"]


def test_figures_draw_on_a_given_axes_and_save(run, tmp_path):
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.subplots()
    assert odp.q_bars(run, ax=ax) is fig
    assert odp.layer_head([run, run]).axes  # a heat map per run + the colour bar
    with pytest.raises(ValueError, match="one per run"):
        odp.layer_head([run, run], axes=[ax])
    # every function takes ax= (layer_head: one axes per run, here one run)
    other = Figure()
    assert odp.layer_head(run, ax=other.subplots()) is other
    with pytest.raises(ValueError, match="'ax' and 'axes'"):
        odp.layer_head(run, ax=ax, axes=ax)
    for empty in ([], {}):
        with pytest.raises(ValueError, match="no runs given"):
            odp.contraction(empty)
    assert save(odp.contraction(run), tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(TypeError, match="argument 'runs'"):
        odp.contraction(42)


def test_d_trajectory_legend_says_what_the_mean_covers(run):
    fig = odp.d_trajectory(run, head=(1, 1), channels=3)
    labels = [line.get_label() for line in _lines(fig)]
    assert "mean over all 8 channels" in labels and "channels 0–2" in labels
    assert "synthetic-osdn: layer 1, head 1" in fig.axes[0].get_title()
    mean = next(line for line in _lines(fig) if line.get_label() == "mean over all 8 channels")
    d = _call(1, 1).d[0, :, 1]  # prompt 0, layer 1: seed 10·0 + 1
    assert list(mean.get_ydata()) == pytest.approx(d.double().mean(-1).tolist(), rel=1e-6)


def test_audit_table_says_why_hypotheses_fail(tmp_path):
    from osdn_diag.report import write_report

    from test_report import _run  # this folder's synthetic-run helper (pytest puts the folder on the path)

    text = write_report([_run(tmp_path / "g", 0, gated=True, task="t")]).read_text()
    # 2 layers × 2 heads × 1 prompt: four streams, every one failing on decay alone.
    assert "| yes | 0 / 4 | state decays: 4 |" in text
