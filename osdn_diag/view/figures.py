"""The view's interactive figures (plotly), built from :func:`osdn_diag.view.data.view_data`'s runs.

Every function takes the list of :class:`~osdn_diag.view.data.RunView` and returns a
``plotly.graph_objects.Figure``; each run has one colour (:func:`run_colour`) in every figure, so
runs side by side read on the same axes. The page (:mod:`osdn_diag.view.page`) draws them with the
plotly.js inlined in it, and links them in the browser: a click on the layer × head heat map redraws
the head curve figure for that cell from the runs' ``head_curves``.

Numbers go in as Python floats, so the JSON holds each value exactly (shortest round-trip repr);
``None`` (a statistic over nothing) is a gap.
"""

from __future__ import annotations

from .data import NUM_BINS, RunView

__all__ = ["FIGURES", "ViewUnavailable", "by_layer", "contraction", "d_trajectory", "eps_vs_q", "head_curve", "layer_head",
           "run_colour"]

#: One colour per run (the first ten of plotly's default qualitative colours), in run order.
COLOURS = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880",
           "#ff97ff", "#fecb52")
_DASH = ("solid", "dash", "dot", "dashdot")
_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "cross", "star", "hexagon")


def run_colour(i: int) -> str:
    return COLOURS[i % len(COLOURS)]


class ViewUnavailable(ImportError):
    """plotly, which the interactive view needs, is not installed or does not import."""


def _go():
    try:
        import plotly.graph_objects as go
    except ImportError as err:  # the extra is optional: the static report never needs it
        raise ViewUnavailable(f"the interactive view needs plotly, which could not be imported ({err}): "
                              "pip install 'osdn-diag[view]' (or pip install plotly)") from err
    return go


def _figure(title: str, **layout):
    go = _go()
    # A small template of our own: plotly's default one would add ~10 KB of JSON to every figure.
    template = go.layout.Template(layout={"font": {"size": 12}, "plot_bgcolor": "#fafafa",
                                          "paper_bgcolor": "white", "hovermode": "closest"})
    fig = go.Figure()
    fig.update_layout(template=template, title={"text": title, "x": 0.01, "font": {"size": 14}},
                      margin={"l": 60, "r": 20, "t": 50, "b": 50}, height=380,
                      legend={"orientation": "h", "y": -0.2}, **layout)
    return fig


def _centers(edges) -> list[float]:
    return [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]


def _bin_names(edges) -> list[str]:
    return [f"[{a:.2f}, {b:.2f})" for a, b in zip(edges[:-1], edges[1:])]


def contraction(runs: list[RunView]):
    """q_geo by relative-position bin (summary.json's ``position_bins``): a line per run, or per (run,
    task) where a run holds several tasks (dash per task); hover: bin, q_geo, n. Dotted vertical lines
    mark where each repeated context starts on average."""
    go = _go()
    fig = _figure("Residual contraction by relative position", yaxis_type="log",
                  xaxis={"title": "relative position in prompt", "range": [0, 1]},
                  yaxis_title="q_geo (log scale)")
    tasks = sorted({t for r in runs for t in r.summary["position_bins"].get("by_task", {})})
    split = any(len(r.summary["position_bins"].get("by_task", {})) > 1 for r in runs)
    starts = {}
    for i, r in enumerate(runs):
        bins = r.summary["position_bins"]
        x, names = _centers(bins["edges"]), _bin_names(bins["edges"])
        series = ([(f"{r.label} · {t}", bins["by_task"][t], _DASH[tasks.index(t) % 4]) for t in sorted(bins["by_task"])]
                  if split else [(r.label, bins, "solid")])
        for name, b, dash in series:
            fig.add_trace(go.Scatter(
                x=x, y=b["q_geo"], name=name, mode="lines+markers",
                line={"color": run_colour(i), "dash": dash}, customdata=[[n, bn] for n, bn in zip(b["n"], names)],
                hovertemplate="%{fullData.name}<br>bin %{customdata[1]}<br>q_geo %{y:.4g}<br>n %{customdata[0]:,}"
                              "<extra></extra>"))
        starts.update(bins.get("repeat_boundary") or {})
    for task, start in sorted(starts.items()):
        fig.add_vline(x=start, line={"dash": "dot", "color": "#666", "width": 1},
                      annotation_text=f"{task}: repeat starts", annotation_font_size=10)
    return fig


def layer_head(runs: list[RunView]):
    """q_geo of every (layer, head) (summary.json's ``by_head``), a heat map per run on one colour
    scale (log10 q_geo); hover: layer, head, q_geo, n. A click draws that head's curve."""
    go = _go()
    from plotly.subplots import make_subplots

    import math

    grids, zs = [], []
    for r in runs:
        L, H = (max(r.layers) + 1 if r.layers else 0), max(r.heads, 1)
        z = [[None] * H for _ in range(L)]
        text = [[None] * H for _ in range(L)]
        n = [[0] * H for _ in range(L)]
        for key, cell in r.summary["by_head"].items():
            layer, head = (int(x) for x in key.split("."))
            if cell["q_geo"] is not None and cell["q_geo"] > 0:
                z[layer][head] = math.log10(cell["q_geo"])
                zs.append(z[layer][head])
            text[layer][head] = cell["q_geo"]
            n[layer][head] = cell["n"]
        grids.append((z, text, n))
    zmin, zmax = (min(zs), max(zs)) if zs else (-1.0, 0.0)
    if zmin == zmax:
        zmin, zmax = zmin - 0.5, zmax + 0.5
    fig = make_subplots(rows=1, cols=len(runs), subplot_titles=[r.label for r in runs], horizontal_spacing=0.06)
    base = _figure("q_geo by layer and head — click a cell for its curve")
    fig.update_layout(base.layout)
    for i, (r, (z, text, n)) in enumerate(zip(runs, grids)):
        fig.add_trace(go.Heatmap(
            z=z, customdata=[[[q, k] for q, k in zip(tr, nr)] for tr, nr in zip(text, n)], zmin=zmin, zmax=zmax,
            colorscale="Viridis", showscale=i == len(runs) - 1, name=r.label,
            colorbar={"title": {"text": "log10 q_geo"}},
            hovertemplate=f"{r.label}<br>layer %{{y}}, head %{{x}}<br>q_geo %{{customdata[0]:.4g}}<br>"
                          "n %{customdata[1]:,}<extra></extra>"), row=1, col=i + 1)
        fig.update_xaxes(title_text="head", dtick=1, row=1, col=i + 1)
        fig.update_yaxes(title_text="layer" if i == 0 else None, dtick=1 if len(z) <= 24 else None, row=1, col=i + 1)
    return fig


def head_curve(runs: list[RunView], layer: int | None = None, head: int = 0):
    """One head's q_geo by relative position, every run that has it (from ``head_curves``; the first
    layer by default). The page redraws it from the same data on a click in the heat map."""
    go = _go()
    if layer is None:
        layer = min((r.layers[0] for r in runs if r.layers), default=0)
    fig = _figure(f"Layer {layer}, head {head}: q_geo by relative position", yaxis_type="log",
                  xaxis={"title": "relative position in prompt", "range": [0, 1]}, yaxis_title="q_geo (log scale)")
    edges = [b / NUM_BINS for b in range(NUM_BINS + 1)]
    for i, r in enumerate(runs):
        if (layer, head) not in r.head_curves:
            continue
        q, n = r.head_curves[(layer, head)]
        fig.add_trace(go.Scatter(x=_centers(edges), y=q, name=r.label, mode="lines+markers",
                                 line={"color": run_colour(i)},
                                 customdata=[[k, b] for k, b in zip(n, _bin_names(edges))],
                                 hovertemplate="%{fullData.name}<br>bin %{customdata[1]}<br>q_geo %{y:.4g}<br>"
                                               "n %{customdata[0]:,}<extra></extra>"))
    return fig


def by_layer(runs: list[RunView]):
    """q_geo of every layer (summary.json's ``by_layer``): grouped bars, a colour per run."""
    go = _go()
    fig = _figure("q_geo by layer", barmode="group", xaxis={"title": "layer", "type": "category"},
                  yaxis_title="q_geo")
    for i, r in enumerate(runs):
        keys = sorted(r.summary["by_layer"], key=int)
        fig.add_trace(go.Bar(x=[str(int(k)) for k in keys], y=[r.summary["by_layer"][k]["q_geo"] for k in keys],
                             name=r.label, marker_color=run_colour(i),
                             customdata=[r.summary["by_layer"][k]["n"] for k in keys],
                             hovertemplate="%{fullData.name}<br>layer %{x}<br>q_geo %{y:.4g}<br>n %{customdata:,}"
                                           "<extra></extra>"))
    return fig


def eps_vs_q(runs: list[RunView]):
    """ε_T^diag of every stream against its q_geo (``comparator.parquet``): a marker shape per run,
    the colour the stream's layer; hover: layer, head, prompt. None when no run has the table."""
    go = _go()
    shown = [(i, r) for i, r in enumerate(runs) if r.eps and r.eps["eps"]]
    if not shown:
        return None
    fig = _figure("Comparator gap ε_T^diag against q_geo, by layer",
                  xaxis_title="ε_T^diag (best fixed diagonal comparator)", yaxis_title="q_geo of the stream")
    top = max(max(r.eps["layer"]) for _, r in shown)
    for k, (i, r) in enumerate(shown):
        e = r.eps
        fig.add_trace(go.Scatter(
            x=e["eps"], y=e["q"], mode="markers", name=r.label,
            marker={"symbol": _SYMBOLS[k % len(_SYMBOLS)], "color": e["layer"], "cmin": 0, "cmax": max(top, 1),
                    "colorscale": "Turbo", "size": 7, "opacity": 0.75,
                    "line": {"color": run_colour(i), "width": 1},
                    "showscale": k == 0, "colorbar": {"title": {"text": "layer"}}},
            customdata=list(zip(e["layer"], e["head"], e["prompt"])),
            hovertemplate="%{fullData.name}<br>layer %{customdata[0]}, head %{customdata[1]}, prompt "
                          "%{customdata[2]}<br>ε_T^diag %{x:.4g}<br>q_geo %{y:.4g}<extra></extra>"))
    fig.update_layout(legend={"orientation": "h", "y": -0.25})
    return fig


def d_trajectory(runs: list[RunView]):
    """The preconditioner of one head over the first prompt, every run that has a d: the mean over its
    channels, with the channels' range shaded where the capture was stored. None when no run has one."""
    go = _go()
    shown = [(i, r) for i, r in enumerate(runs) if r.d]
    if not shown:
        return None
    fig = _figure("The preconditioner d over the first prompt", xaxis_title="position", yaxis_title="d_t")
    for i, r in shown:
        d = r.d
        if d["min"] is not None:
            fig.add_trace(go.Scatter(x=d["t"] + d["t"][::-1], y=d["max"] + d["min"][::-1], fill="toself",
                                     fillcolor=run_colour(i), opacity=0.15, line={"width": 0}, hoverinfo="skip",
                                     showlegend=False, name=f"{r.label} channel range"))
        what = "mean over channels" if d["source"] == "capture" else "key-weighted mean ⟨d, k⊙k⟩/‖k‖²"
        fig.add_trace(go.Scatter(x=d["t"], y=d["mean"], mode="lines", name=f"{d['title']} ({what})",
                                 line={"color": run_colour(i)},
                                 hovertemplate="%{fullData.name}<br>position %{x}<br>d %{y:.4g}<extra></extra>"))
    return fig


#: The figures of a page, by the id of the panel that holds each.
FIGURES = {"contraction": contraction, "layer-head": layer_head, "head-curve": head_curve,
           "by-layer": by_layer, "eps-vs-q": eps_vs_q, "d-trajectory": d_trajectory}
