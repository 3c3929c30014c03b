"""Plots of one or more runs' summaries (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

from .._atomic import atomic_path

__all__ = [
    "plot_by_layer",
    "plot_contraction",
    "plot_d_trajectory",
    "plot_eps_vs_q",
    "plot_layer_head",
    "plot_q_bars",
    "plot_retained",
]


def _num(x) -> float:
    """A summary value as a float: ``null`` (a statistic over no measurement) plots as a gap."""
    return float("nan") if x is None else float(x)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """Save ``path`` (PNG) and the same figure as PDF beside it, each through a temporary file and a
    rename: a crash never leaves a half-written image."""
    for target in (path, path.with_suffix(".pdf")):
        with atomic_path(target, suffix=target.suffix) as tmp:  # matplotlib reads the format from it
            fig.savefig(tmp, dpi=150, bbox_inches="tight")
    plt = _pyplot()
    plt.close(fig)
    return path


def _finish(fig, ax, path: Path, *, xlabel: str, ylabel: str, title: str, legend: bool = True,
            title_size: float | None = None) -> Path:
    """Labels, grid and legend every line plot here shares; then save."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, **({} if title_size is None else {"fontsize": title_size}))
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_contraction(runs: list[tuple[str, dict]], path: Path) -> Path:
    """Fig. 2(a): geometric mean of q_t by relative-position bin, one line per run; the dashed line
    marks where the repeated context starts (mean over prompts that repeat)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    boundaries = set()
    for label, summary in runs:
        bins = summary["position_bins"]
        edges = bins["edges"]
        centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:])]
        ax.plot(centers, [_num(x) for x in bins["q_geo"]], marker="o",
                label=f"{label} (q_geo {_num(summary['q_geo']):.3f})")
        boundaries.update(round(v, 3) for v in bins.get("repeat_boundary", {}).values())
    for b in sorted(boundaries):
        ax.axvline(b, color="0.4", linestyle="--", linewidth=1)
    if boundaries:
        ax.text(min(boundaries), ax.get_ylim()[1], " repeat starts", va="top", fontsize=8, color="0.3")
    ax.set_xlim(0, 1)
    return _finish(fig, ax, path, xlabel="relative position in prompt",
                   ylabel=r"$q_{geo}$ = geometric mean of $f_t(S_t)/f_t(S_{t-1})$",
                   title="Residual contraction by position")


def plot_by_layer(runs: list[tuple[str, dict]], path: Path) -> Path:
    """q_geo of every layer, one line per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, summary in runs:
        layers = sorted(summary["by_layer"], key=int)
        ax.plot([int(layer) for layer in layers], [_num(summary["by_layer"][layer]["q_geo"]) for layer in layers],
                marker="o", label=label)
    return _finish(fig, ax, path, xlabel="layer", ylabel=r"$q_{geo}$", title="Residual contraction by layer")


def plot_q_bars(runs: list[tuple[str, dict]], path: Path) -> Path:
    """Fig. 2(b): overall q_geo of each run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(runs), 3.6))
    labels = [label for label, _ in runs]
    values = [_num(s["q_geo"]) for _, s in runs]
    bars = ax.bar(range(len(runs)), values, color=[f"C{i}" for i in range(len(runs))])
    for bar, v in zip(bars, values):
        if v != v:  # nothing measured: no bar, and no label at a NaN height
            continue
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(runs)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(r"$q_{geo}$ (all tokens, layers, heads)")
    ax.set_title("Overall residual contraction")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_layer_head(runs: list[tuple[str, dict]], path: Path) -> Path:
    """q_geo of every (layer, head), one heat map per run."""
    import numpy as np

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(4.2 * len(runs), 3.8), squeeze=False,
                             constrained_layout=True)
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
    for ax, (label, _), grid in zip(axes[0], runs, grids):
        L, H = grid.shape
        im = ax.imshow(grid, aspect="auto", cmap="viridis", origin="lower", vmin=vmin, vmax=vmax)
        ax.set_xticks(range(0, H, max(1, H // 8)))
        ax.set_yticks(range(0, L, max(1, L // 12)))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(label, fontsize=9)
    fig.colorbar(im, ax=list(axes[0]), label=r"$q_{geo}$")
    return _save(fig, path)


def plot_eps_vs_q(runs: list[tuple[str, list[float], list[float]]], path: Path) -> Path:
    """ε_T^diag of each (prompt, layer, head) stream against that stream's q_geo."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.6, 4.2))
    for label, eps, q in runs:
        ax.scatter(eps, q, s=8, alpha=0.6, label=label)
    return _finish(fig, ax, path, xlabel=r"$\varepsilon_T^{diag}$ (best fixed diagonal comparator)",
                   ylabel=r"$q_{geo}$ of the stream", title="Comparator gap against measured contraction")


def plot_d_trajectory(d, title: str, path: Path, channels: int = 8) -> Path:
    """``d: [T, K]`` of one head: the first ``channels`` coordinates, and the mean over all."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    t = range(d.shape[0])
    for i in range(min(channels, d.shape[1])):
        ax.plot(t, d[:, i], linewidth=0.8, alpha=0.7)
    ax.plot(t, d.mean(1), color="k", linewidth=1.6, label="mean over channels")
    return _finish(fig, ax, path, xlabel="position", ylabel=r"$d_t$", title=title, title_size=9)


def plot_retained(runs: list[tuple[str, dict]], path: Path) -> Path:
    """Mean retrieval error of earlier writes by distance t − j, per run and task."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, per_task in runs:
        for task, r in per_task.items():
            x = [max(lo, 0.5) for lo, _ in r["distance_bins"]]
            ax.plot(x, r["mean_error"], marker="o", label=f"{label} · {task}")
    ax.set_xscale("log", base=2)
    return _finish(fig, ax, path, xlabel="distance t − j (bin start; 0 drawn at 1/2)",
                   ylabel=r"mean $\|S_t k_j - v_j\|^2 / \|v_j\|^2$", title="Retained associations")
