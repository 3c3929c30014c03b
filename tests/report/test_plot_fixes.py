"""The static figures as a reader sees them: a saved figure keeps its legend (a plain ``savefig``,
without a tight bounding box), no axis label is clipped, layers (categories) are points not a line,
ε_T^diag vs q_geo tells the layers apart, and the d plot has every run that has a d.

Runs: two synthetic OSDN captures (no model) of two layers, two heads, two tasks, with different d.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

import osdn_diag.plot as odp
from osdn_diag.capture import CaptureWriter, KernelCall
from osdn_diag.math import osdn
from osdn_diag.pipeline import replay_run

B, T, H, K = 1, 16, 2, 4


def _call(layer: int, seed: int, d_scale: float):
    gen = torch.Generator().manual_seed(seed)
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    beta = torch.rand(B, T, H, generator=gen) * 0.4
    d = 0.5 + d_scale * torch.rand(B, T, H, K, generator=gen)
    return KernelCall(layer=layer, layer_name=f"layers.{layer}", family="osdn", kernel="x", q=q, k=k, v=v,
                      beta=beta, d=d, o=osdn(q, k, v, beta, d).o, scale=K**-0.5)


def _run(path, spec, d_scale):
    w = CaptureWriter(path)
    w.begin({"model": {"spec": spec}, "prompts_source": "test",
             "prompts": [{"id": 0, "task": "once", "length": T},
                         {"id": 1, "task": "twice", "length": T, "repeat_start": 8}]})
    for prompt in (0, 1):
        for layer in range(2):
            w.write(prompt, [prompt], _call(layer, 10 * prompt + layer, d_scale))
    w.finish({"kernels": ["fla"]})
    replay_run(path, progress=False)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fixes")
    return _run(root / "a", "model-a", 1.5), _run(root / "b", "model-b-with-a-long-name (per micro-step)", 0.1)


def _inside(fig, artist):
    """Whether ``artist`` lies inside the figure once drawn as a plain ``savefig`` draws it."""
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    box, page = artist.get_window_extent(fig.canvas.get_renderer()), fig.bbox
    return box.x0 >= -0.5 and box.y0 >= -0.5 and box.x1 <= page.x1 + 0.5 and box.y1 <= page.y1 + 0.5


def test_a_legend_of_many_curves_stays_inside_the_saved_figure(runs):
    fig = odp.contraction({"A": runs[0], "B": runs[1]})  # 2 runs × 2 tasks: 4 entries
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends and len(legends[0].get_texts()) == 4
    assert all(_inside(fig, legend) for legend in legends)


def test_q_bars_never_clips_its_labels(runs):
    fig = odp.q_bars({"a run with a long label (per micro-step)": runs[0],
                      "another run with a long label too": runs[1]})
    ax = fig.axes[0]
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    for text in [*ax.get_xticklabels(), ax.yaxis.label, ax.title]:
        assert _inside(fig, text), text.get_text()


def test_by_layer_draws_points_not_a_line(runs):
    fig = odp.by_layer([runs[0], runs[1]])
    lines = fig.axes[0].get_lines()
    assert len(lines) == 2 and all(line.get_linestyle() == "None" and line.get_marker() == "o" for line in lines)
    # side by side within each layer's slot, never on top of each other
    assert set(lines[0].get_xdata()).isdisjoint(lines[1].get_xdata())


def test_eps_vs_q_is_coloured_by_layer(runs):
    fig = odp.eps_vs_q(runs[0])
    t = pq.read_table(runs[0] / "comparator.parquet").to_pydict()
    layers = [layer for layer, n in zip(t["layer"], t["n_valid"]) if n]
    coloured = [c for c in fig.axes[0].collections if c.get_array() is not None]
    assert len(coloured) == 1 and list(coloured[0].get_array()) == layers and len(set(layers)) == 2
    assert any(ax.get_ylabel() == "layer" for ax in fig.axes)  # the colour bar says what the colour is


def test_the_d_plot_has_every_run_with_a_d(runs, tmp_path, monkeypatch):
    fig = odp.d_trajectory([runs[0], runs[1]])
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 2 and titles[0].startswith("model-a:") and titles[1] != titles[0]
    from osdn_diag.report import markdown

    drawn = []
    monkeypatch.setattr(markdown, "draw", lambda figures: drawn.extend(figures))
    markdown.write_report(list(runs), tmp_path / "cmp", ["A", "B"])
    d_fig = next(f for f in drawn if f.path.name == "d_trajectory.png")
    assert [title.split(":")[0] for _, title in d_fig.args[0]] == ["A", "B"]
