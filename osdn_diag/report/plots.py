"""Plots of one or more runs' summaries (matplotlib, no display needed)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["plot_by_layer", "plot_contraction"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    """Save through a temporary file and a rename: a crash never leaves a half-written image."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=150, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


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
        ax.plot(centers, bins["q_geo"], marker="o", label=f"{label} (q_geo {summary['q_geo']:.3f})")
        boundaries.update(round(v, 3) for v in bins.get("repeat_boundary", {}).values())
    for b in sorted(boundaries):
        ax.axvline(b, color="0.4", linestyle="--", linewidth=1)
    if boundaries:
        ax.text(min(boundaries), ax.get_ylim()[1], " repeat starts", va="top", fontsize=8, color="0.3")
    ax.set_xlabel("relative position in prompt")
    ax.set_ylabel(r"$q_{geo}$ = geometric mean of $f_t(S_t)/f_t(S_{t-1})$")
    ax.set_xlim(0, 1)
    ax.set_title("Residual contraction by position")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = _save(fig, path)
    plt.close(fig)
    return path


def plot_by_layer(runs: list[tuple[str, dict]], path: Path) -> Path:
    """q_geo of every layer, one line per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, summary in runs:
        layers = sorted(summary["by_layer"], key=int)
        ax.plot([int(layer) for layer in layers], [summary["by_layer"][layer]["q_geo"] for layer in layers],
                marker="o", label=label)
    ax.set_xlabel("layer")
    ax.set_ylabel(r"$q_{geo}$")
    ax.set_title("Residual contraction by layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = _save(fig, path)
    plt.close(fig)
    return path
