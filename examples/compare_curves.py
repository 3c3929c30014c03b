"""Plot the contraction curves of two (or more) runs side by side.

    python examples/compare_curves.py RUN_A RUN_B [--labels A B] [--out curves.png]

Each RUN is a directory written by ``osdn-diag run`` (or ``demo``). The left panel is the Fig. 2a
curve — q_geo per relative-position bin, the repeated context's start marked — and the right panel
the per-layer q_geo, one line per run.
"""

from __future__ import annotations

import argparse

from osdn_diag.report.markdown import load_run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--labels", nargs="+")
    p.add_argument("--out", default="curves.png")
    a = p.parse_args()
    labels = a.labels or a.runs
    if len(labels) != len(a.runs):
        raise SystemExit(f"--labels: expected {len(a.runs)} labels, got {len(labels)}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for label, run in zip(labels, a.runs):
        _, s = load_run(run)
        bins = s["position_bins"]
        edges = bins["edges"]
        mids = [(lo + hi) / 2 for lo, hi in zip(edges[:-1], edges[1:])]
        left.plot(mids, bins["q_geo"], marker="o", label=label)
        for boundary in bins.get("repeat_boundary", {}).values():
            left.axvline(boundary, color="grey", linestyle=":", linewidth=1)
        layers = sorted(s["by_layer"], key=int)
        right.plot([int(x) for x in layers], [s["by_layer"][x]["q_geo"] for x in layers], marker="s", label=label)
        right.set_xticks([int(x) for x in layers])
    left.set(xlabel="relative position", ylabel="q_geo (lower = stronger contraction)", title="contraction curve")
    right.set(xlabel="layer", ylabel="q_geo", title="by layer")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=150)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
