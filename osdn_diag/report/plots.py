"""Plots of one or more runs' summaries (matplotlib).

Each ``plot_*`` draws on ``ax`` (a new figure when ``None``) and returns the figure, so a notebook
shows it and a caller may restyle it; :func:`save` writes it as PNG and PDF. The report uses these
same functions; :mod:`osdn_diag.plot` takes run directories or in-memory results and calls them.
A run is ``(label, summary)``, the summary being ``summary.json``'s dictionary.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path

from ..runtime.atomic import atomic_path

__all__ = [
    "save",
    "save_as",
    "plot_by_layer",
    "plot_contraction",
    "plot_d_trajectory",
    "plot_d_trajectories",
    "plot_eps_vs_q",
    "plot_layer_head",
    "plot_q_bars",
    "plot_retained",
]


def _num(x) -> float:
    """A summary value as a float: ``null`` (a statistic over no measurement) plots as a gap."""
    return float("nan") if x is None else float(x)


def save(fig, path: Path) -> Path:
    """Save ``path`` (PNG) and the same figure as PDF beside it, each through a temporary file and a
    rename: a crash never leaves a half-written image."""
    for target in (path, path.with_suffix(".pdf")):
        save_as(fig, target)
    return path


def save_as(fig, target: Path) -> Path:
    """Save the figure to ``target`` alone, in the format its suffix names, through a temporary file
    and a rename. The same figure gives the same bytes: a PDF carries no creation date."""
    metadata = {"CreationDate": None} if target.suffix.lower() == ".pdf" else None
    with atomic_path(target, suffix=target.suffix) as tmp:  # matplotlib reads the format from it
        fig.savefig(tmp, dpi=150, bbox_inches="tight", metadata=metadata)
    return target


#: Families that hold the glyphs DejaVu Sans (matplotlib's default) lacks — CJK above all — tried in
#: this order for a character the default font does not have, wherever one is installed.
FALLBACK_FONTS = (
    "Noto Sans CJK JP", "Noto Sans CJK SC", "Noto Sans CJK TC", "Noto Sans CJK KR", "Source Han Sans",
    "Noto Sans JP", "Noto Sans SC", "Noto Sans TC", "Noto Sans KR", "WenQuanYi Zen Hei", "WenQuanYi Micro Hei",
    "Droid Sans Fallback", "IPAexGothic", "IPAGothic", "Microsoft YaHei", "SimHei", "Malgun Gothic",
    "Hiragino Sans", "PingFang SC", "Apple SD Gothic Neo", "Arial Unicode MS",
)

_GLYPH = re.compile(r"Glyph (\d+) .*missing from font")


@contextlib.contextmanager
def label_fonts(missing: set[str]):
    """Draw and save a report figure inside this block: text falls back, glyph by glyph, to the first
    installed family of :data:`FALLBACK_FONTS` (run labels and task names in Chinese, Japanese or
    Korean); the characters no installed font has are added to ``missing`` instead of one matplotlib
    warning each per file (the caller says so once). The Python API's plots keep the caller's rcParams."""
    import matplotlib
    from matplotlib import font_manager

    installed = {f.name for f in font_manager.fontManager.ttflist}
    family = list(matplotlib.rcParams["font.family"]) + [f for f in FALLBACK_FONTS if f in installed]
    with matplotlib.rc_context({"font.family": family}), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        m = _GLYPH.search(str(w.message))
        if m:
            missing.add(chr(int(m.group(1))))
        else:  # any other warning as it came
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def missing_glyphs_note(missing: set[str]) -> str:
    """The one line that says which characters of the plots' labels show as boxes, and what to do."""
    chars = sorted(missing)
    shown = ", ".join(chars[:8]) + (", …" if len(chars) > 8 else "")
    return (f"note: {len(chars)} character{'s' if len(chars) != 1 else ''} of the plots' labels ({shown}) "
            "are in no installed font and show as boxes; install a font that has them (Chinese, Japanese, "
            "Korean: Noto Sans CJK, Debian's fonts-noto-cjk) and the report's plots use it")


def _figure(figsize, **kwargs):
    """A figure outside pyplot: no backend is chosen or changed (a notebook keeps its own, a server
    needs none) and nothing stays registered after the caller drops it. Jupyter shows it as returned."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, **kwargs)


def _axes(ax, figsize):
    """``(figure, axes)``: ``ax``'s own, or a new figure of ``figsize`` with a constrained layout, which
    makes room for every label and for a legend placed outside the axes (:func:`_finish`), so that a
    plain ``fig.savefig`` (without ``bbox_inches="tight"``) clips neither."""
    if ax is not None:
        return ax.figure, ax
    fig = _figure(figsize, layout="constrained")
    return fig, fig.subplots()


def _finish(fig, ax, *, xlabel: str, ylabel: str, title: str, legend: bool = True,
            title_size: float | None = None):
    """Labels, grid and legend every line plot here shares."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, **({} if title_size is None else {"fontsize": title_size}))
    ax.grid(alpha=0.3)
    if legend:
        entries = len(ax.get_legend_handles_labels()[1])
        own = fig.get_layout_engine() is not None and len(fig.axes) == 1
        if entries > 3 and own:
            # Beside many curves a legend inside the axes covers some of them: below the axes, as a
            # figure legend that the constrained layout makes room for inside the figure's bounds.
            fig.legend(*ax.get_legend_handles_labels(), fontsize=8, loc="outside lower center", ncol=2,
                       frameon=False)
        else:  # a caller's axes, or a few entries: inside the axes, so inside any figure
            ax.legend(fontsize=8)
    return fig


def plot_contraction(runs: list[tuple[str, dict]], ax=None):
    """Fig. 2(a): geometric mean of q_t by relative-position bin. A run whose prompts are all of one
    task is one line; a run of several tasks (e.g. single and repeated context) gets a line per task —
    colour per run, line style per task — because pooling a once-read and a twice-read context mixes
    two curves. Where a task repeats its context, a dashed line in that task's style marks the
    repeat's mean start."""
    fig, ax = _axes(ax, (6.4, 4.0))
    tasks = sorted({t for _, s in runs for t in s["position_bins"].get("by_task", {})})
    split = any(len(s["position_bins"].get("by_task", {})) > 1 for _, s in runs)
    style = {t: ("-", "--", ":", "-.")[i % 4] for i, t in enumerate(tasks)}
    starts = {}  # task -> where its repeat starts (one marker per task, whichever run has it)
    for i, (label, summary) in enumerate(runs):
        bins = summary["position_bins"]
        edges = bins["edges"]
        centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
        if split:
            for task in sorted(bins["by_task"]):
                ax.plot(centers, [_num(x) for x in bins["by_task"][task]["q_geo"]], marker="o", color=f"C{i}",
                        linestyle=style[task], label=f"{label} · {task}")
        else:
            ax.plot(centers, [_num(x) for x in bins["q_geo"]], marker="o", color=f"C{i}",
                    label=f"{label} (q_geo {_num(summary['q_geo']):.3f})")
        starts.update(bins.get("repeat_boundary") or {})
    for task, start in sorted(starts.items()):
        ax.axvline(start, color="0.4", linestyle="--" if style.get(task, "-") == "-" else style[task], linewidth=1)
        ax.text(start, ax.get_ylim()[1], f" {task}: repeat starts", va="top", fontsize=7, color="0.3")
    ax.set_xlim(0, 1)
    return _finish(fig, ax, xlabel="relative position in prompt",
                   ylabel=r"$q_{geo}$ = geometric mean of $f_t(S_t)/f_t(S_{t-1})$",
                   title="Residual contraction by position")


def plot_by_layer(runs: list[tuple[str, dict]], ax=None):
    """q_geo of every layer, a point per layer and run: layers are categories, so the points are not
    joined by a line; several runs are set side by side within each layer's slot."""
    fig, ax = _axes(ax, (6.4, 4.0))
    width = 0.6 / max(len(runs), 1)
    for i, (label, summary) in enumerate(runs):
        layers = sorted(summary["by_layer"], key=int)
        offset = (i - (len(runs) - 1) / 2) * width if len(runs) > 1 else 0.0
        ax.plot([int(layer) + offset for layer in layers],
                [_num(summary["by_layer"][layer]["q_geo"]) for layer in layers],
                marker="o", linestyle="none", color=f"C{i}", label=label)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
    return _finish(fig, ax, xlabel="layer", ylabel=r"$q_{geo}$", title="Residual contraction by layer")


def plot_q_bars(runs: list[tuple[str, dict]], ax=None):
    """Fig. 2(b): overall q_geo of each run."""
    fig, ax = _axes(ax, (max(4.2, 1.4 + 1.1 * len(runs)), 3.6))  # wide enough for its title
    labels = [label for label, _ in runs]
    values = [_num(s["q_geo"]) for _, s in runs]
    bars = ax.bar(range(len(runs)), values, color=[f"C{i}" for i in range(len(runs))])
    for bar, v in zip(bars, values):
        if v != v:  # nothing measured: no bar, and no label at a NaN height
            continue
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(runs)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(r"$q_{geo}$ (all tokens, layers, heads)")
    ax.set_title("Overall residual contraction", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return fig


def plot_layer_head(runs: list[tuple[str, dict]], axes=None):
    """q_geo of every (layer, head), one heat map per run."""
    import numpy as np

    if axes is None:
        fig = _figure((4.2 * len(runs), 3.8), layout="constrained")
        axes = list(fig.subplots(1, len(runs), squeeze=False)[0])
    else:
        axes = [axes] if hasattr(axes, "imshow") else list(axes)
        if len(axes) != len(runs):
            raise ValueError(f"argument 'axes': one per run ({len(runs)}), got {len(axes)}")
        fig = axes[0].figure
    grids = []
    for _, s in runs:
        keys = [tuple(int(x) for x in k.split(".")) for k in s["by_head"]]
        grid = np.full((max((k[0] for k in keys), default=0) + 1, max((k[1] for k in keys), default=0) + 1),
                       np.nan)
        for (layer, head), key in zip(keys, s["by_head"]):
            grid[layer, head] = _num(s["by_head"][key]["q_geo"])
        grids.append(grid)
    # One colour scale, so the runs compare by eye (over the cells measured; any, if none were).
    measured = np.concatenate([g[np.isfinite(g)] for g in grids])
    vmin, vmax = (measured.min(), measured.max()) if measured.size else (0.0, 1.0)
    for ax, (label, _), grid in zip(axes, runs, grids):
        L, H = grid.shape
        im = ax.imshow(grid, aspect="auto", cmap="viridis", origin="lower", vmin=vmin, vmax=vmax)
        ax.set_xticks(range(0, H, max(1, H // 8)))
        ax.set_yticks(range(0, L, max(1, L // 12)))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(label, fontsize=9)
    fig.colorbar(im, ax=axes, label=r"$q_{geo}$")
    return fig


def plot_eps_vs_q(runs: list[tuple], ax=None):
    """ε_T^diag of each (prompt, layer, head) stream against that stream's q_geo, by layer: a run is
    ``(label, eps, q, layer)`` (``layer`` per stream; ``(label, eps, q)`` draws every stream in one
    colour). The colour is the stream's layer (a colour bar says which), the marker shape the run."""
    import numpy as np

    fig, ax = _axes(ax, (6.2, 4.4))
    layered = [r for r in runs if len(r) > 3 and len(r[3])]
    top = max((max(r[3]) for r in layered), default=0)
    norm = None
    if layered:
        from matplotlib.colors import Normalize

        norm = Normalize(vmin=0, vmax=max(top, 1))
    mappable = None
    for i, run in enumerate(runs):
        label, eps, q = run[:3]
        marker = "osD^vP*X"[i % 8]
        if len(run) > 3 and len(run[3]):
            mappable = ax.scatter(eps, q, s=14, alpha=0.75, c=np.asarray(run[3], dtype=float), cmap="viridis",
                                  norm=norm, marker=marker, edgecolors="none")
            ax.scatter([], [], s=14, marker=marker, color="0.35", label=label)  # the legend's key: shape only
        else:
            ax.scatter(eps, q, s=8, alpha=0.6, marker=marker, label=label)
    if mappable is not None:
        bar = fig.colorbar(mappable, ax=ax, label="layer")
        if top <= 24:
            bar.set_ticks(range(0, top + 1, max(1, (top + 1) // 8)))
    return _finish(fig, ax, xlabel=r"$\varepsilon_T^{diag}$ (best fixed diagonal comparator)",
                   ylabel=r"$q_{geo}$ of the stream", title="Comparator gap against measured contraction, by layer")


def plot_d_trajectory(d, title: str, ax=None, channels: int = 8):
    """``d: [T, K]`` of one head: the first ``channels`` coordinates, and the mean over all ``K`` —
    which the legend says, since it may lie outside the channels drawn."""
    fig, ax = _axes(ax, (6.4, 3.8))
    t = range(d.shape[0])
    shown = min(channels, d.shape[1])
    for i in range(shown):
        ax.plot(t, d[:, i], linewidth=0.8, alpha=0.7, label=f"channels 0–{shown - 1}" if i == 0 else None)
    ax.plot(t, d.mean(1), color="k", linewidth=1.6, label=f"mean over all {d.shape[1]} channels")
    return _finish(fig, ax, xlabel="position", ylabel=r"$d_t$", title=title, title_size=9)


def plot_d_trajectories(series: list[tuple], channels: int = 8):
    """Every run that has a d: ``series`` of ``(d: [T, K], title)``, a panel each, one above the other
    on the same axes' scale, so one run's d settling (OSDN) and another's collapsing to the box's
    lower end (OSDN-APF) read side by side."""
    fig = _figure((6.4, 1.2 + 2.6 * len(series)), layout="constrained")
    axes = fig.subplots(len(series), 1, squeeze=False, sharex=False, sharey=True)[:, 0]
    for ax, (d, title) in zip(axes, series):
        plot_d_trajectory(d, title, ax=ax, channels=channels)
    return fig


def plot_retained(runs: list[tuple[str, dict]], ax=None):
    """Mean retrieval error of earlier writes by distance t − j, per run and task."""
    fig, ax = _axes(ax, (6.4, 4.0))
    for label, per_task in runs:
        for task, r in per_task.items():
            x = [max(lo, 0.5) for lo, _ in r["distance_bins"]]
            ax.plot(x, r["mean_error"], marker="o", label=f"{label} · {task}")
    ax.set_xscale("log", base=2)
    return _finish(fig, ax, xlabel="distance t − j (bin start; 0 drawn at 1/2)",
                   ylabel=r"mean $\|S_t k_j - v_j\|^2 / \|v_j\|^2$", title="Retained associations")
