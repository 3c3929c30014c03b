"""Plots for a notebook: each function takes runs and returns a matplotlib figure.

    import osdn_diag.plot as odp
    odp.contraction(["runs/deltanet", "runs/osdn"])          # run directories
    odp.contraction(res)                                     # osdn_diag.replay(cap)'s Results
    odp.by_layer({"DeltaNet": "runs/deltanet", "OSDN": res}, ax=my_ax)

A *run* is a run directory (``str`` or ``Path``), a :class:`~osdn_diag.replay.Results`, or a
``summary.json`` dictionary; ``runs`` is one run, a list of them (labelled by their model spec or
``run 0, 1, ...``), or a ``{label: run}`` mapping. Functions draw on ``ax`` when given (a new figure
otherwise) and return the figure, which Jupyter shows; ``osdn_diag.report.plots.save(fig, path)``
writes it as PNG + PDF. These are the report's own plots, drawn by the same code.

This module sits after the report in the data flow (capture → replay → metrics → report → plot): it
only reads finished runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from .report import plots as _plots

__all__ = ["by_layer", "contraction", "d_trajectory", "eps_vs_q", "layer_head", "q_bars", "retained", "training"]


def _is_summary(x) -> bool:
    """A ``summary.json`` dictionary (rather than a ``{label: run}`` mapping)."""
    return isinstance(x, Mapping) and "q_geo" in x and "position_bins" in x


def _one(run, default_label: str) -> tuple[str, dict, Path | None]:
    """``(label, summary, run directory or None)`` of one run."""
    from .replay import load_run
    from .report.markdown import _label
    from .replay import Results

    if isinstance(run, (str, os.PathLike)):
        manifest, summary = load_run(run)
        return _label(Path(run), manifest), summary, Path(run)
    if isinstance(run, Results):
        return default_label, run.summary, None
    if _is_summary(run):
        return default_label, dict(run), None
    raise TypeError(f"argument 'runs': expected a run directory, a Results or a summary dictionary, "
                    f"got {type(run).__name__}")


def _runs(runs) -> list[tuple[str, dict, Path | None]]:
    if isinstance(runs, Mapping) and not _is_summary(runs):
        if not runs:
            raise ValueError("argument 'runs': no runs given")
        return [(str(label), *_one(run, str(label))[1:]) for label, run in runs.items()]
    if isinstance(runs, (list, tuple)):
        if not runs:
            raise ValueError("argument 'runs': no runs given")
        from .report.markdown import distinct_labels

        parts = [_one(run, f"run {i}") for i, run in enumerate(runs)]
        names = distinct_labels([label for label, _, _ in parts], [run_dir for _, _, run_dir in parts])
        return [(name, summary, run_dir) for name, (_, summary, run_dir) in zip(names, parts)]
    return [_one(runs, "run")]


def _pairs(runs) -> list[tuple[str, dict]]:
    return [(label, summary) for label, summary, _ in _runs(runs)]


def contraction(runs, ax=None):
    """Fig. 2(a): q_geo by relative position — a line per run, or per (run, task) when a run holds
    several tasks (single and repeated context apart), with where each repeat starts."""
    return _plots.plot_contraction(_pairs(runs), ax=ax)


def by_layer(runs, ax=None):
    """q_geo of every layer, a line per run."""
    return _plots.plot_by_layer(_pairs(runs), ax=ax)


def q_bars(runs, ax=None):
    """Fig. 2(b): each run's overall q_geo."""
    return _plots.plot_q_bars(_pairs(runs), ax=ax)


def layer_head(runs, ax=None, *, axes=None):
    """q_geo of every (layer, head), a heat map per run on one colour scale; ``ax`` (or ``axes``): one
    axes per run, a single one for one run."""
    if ax is not None and axes is not None:
        raise ValueError("arguments 'ax' and 'axes': the same thing (one axes per run); give one of them")
    return _plots.plot_layer_head(_pairs(runs), axes=axes if ax is None else ax)


def retained(runs, ax=None):
    """Mean retrieval error of earlier writes by distance, for runs replayed with ``--retained``."""
    pairs = [(label, s["retained"]) for label, s in _pairs(runs) if s.get("retained")]
    if not pairs:
        raise ValueError("argument 'runs': no run was replayed with --retained")
    return _plots.plot_retained(pairs, ax=ax)


def eps_vs_q(runs, ax=None):
    """ε_T^diag against q_geo per (prompt, layer, head) stream, from each run directory's
    ``comparator.parquet``."""
    from .report.markdown import eps_q_series

    found = [(label, path) for label, _, path in _runs(runs) if path is not None]
    series = eps_q_series([p for _, p in found], [label for label, _ in found])
    if not series:
        raise ValueError("argument 'runs': no run directory with comparator.parquet (replay writes it)")
    return _plots.plot_eps_vs_q(series, ax=ax)


def d_trajectory(runs, head: tuple[int, int] | None = None, ax=None, channels: int = 8):
    """The preconditioner ``d_t`` of one head over the first prompt, from run directories whose capture
    was stored: ``head = (layer, head)``, by default head 0 of the first layer that has a ``d``. One
    run: one axes (``ax`` when given); several: a panel for every run that has a d (so OSDN's and
    OSDN-APF's read side by side)."""
    from .report.markdown import d_trajectories_of
    from .capture.store import read_manifest

    found = [(label, path) for label, _, path in _runs(runs)]
    if any(path is None for _, path in found):
        raise TypeError("argument 'runs': the d trajectory is read from run directories' stored captures")
    series = d_trajectories_of([p for _, p in found], [label for label, _ in found],
                               [read_manifest(p) for _, p in found], head)
    if not series:
        where = found[0][1] if len(found) == 1 else "argument 'runs'"
        raise ValueError(f"{where}: no stored capture with a preconditioner d (an OSDN-family run, "
                         "captured without --stream)")
    if len(series) == 1:
        d, title = series[0]
        return _plots.plot_d_trajectory(d, title, ax=ax, channels=channels)
    if ax is not None:
        raise ValueError(f"argument 'ax': {len(series)} runs have a d, a panel each; leave ax out")
    return _plots.plot_d_trajectories(series, channels=channels)


def _monitor_table(source):
    """A monitor's rows as a pyarrow table: from a ``monitor.parquet`` (or its directory), a
    :class:`~osdn_diag.monitor.Monitor` (its ``table()``) or a table already read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if isinstance(source, pa.Table):
        return source
    if hasattr(source, "table") and callable(source.table):
        return source.table()
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        return pq.read_table(path / "monitor.parquet" if path.is_dir() else path)
    raise TypeError(f"argument 'source': expected a monitor.parquet, its directory, a Monitor or a pyarrow table, "
                    f"got {type(source).__name__}")


def training(source, ax=None, layers: bool = True, metric: str = "q_geo"):
    """q_geo against training step from :mod:`osdn_diag.monitor`'s rows: a thick line per model (all
    layers), and with ``layers`` a thin one per layer in the same colour. ``source``: a
    ``monitor.parquet`` or its directory, a ``Monitor``, a pyarrow table, or a list of these (their rows
    together, e.g. one file per model). ``metric``: ``"q_geo"``, ``"q_arith"`` or a d statistic."""
    import pyarrow as pa

    sources = list(source) if isinstance(source, (list, tuple)) else [source]
    if not sources:
        raise ValueError("argument 'source': nothing given")
    table = pa.concat_tables([_monitor_table(s) for s in sources], promote_options="default")
    if metric not in table.column_names:
        raise ValueError(f"argument 'metric': expected one of the monitor's columns, got {metric!r}")
    rows = table.select(["model", "step", "layer", metric]).to_pylist()
    if not rows:
        raise ValueError("argument 'source': the monitor recorded no probe yet")
    fig, ax = _plots._axes(ax, (6.4, 4.0))
    models = list(dict.fromkeys(r["model"] for r in rows))
    for i, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model and r[metric] is not None]
        for layer in sorted({r["layer"] for r in mine}):
            if layer >= 0 and not layers:
                continue
            pts = sorted((r["step"], r[metric]) for r in mine if r["layer"] == layer)
            whole = layer < 0
            ax.plot([s for s, _ in pts], [v for _, v in pts], color=f"C{i}", lw=2.0 if whole else 0.8,
                    alpha=1.0 if whole else 0.5, marker="o" if whole else None, ms=3,
                    label=f"{model}" if whole else (f"{model}, layer {layer}" if len(models) == 1 else None))
    label = {"q_geo": r"$q_{geo}$", "q_arith": r"$q_{arith}$"}.get(metric, metric)
    return _plots._finish(fig, ax, xlabel="training step", ylabel=label, title=f"{label} during training")
