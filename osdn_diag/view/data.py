"""What the interactive view shows, reduced from a run's files: :func:`view_data`.

A run is a run directory (``residuals.parquet``, ``summary.json``, ``manifest.json``,
``tokens.parquet``, ``comparator.parquet``, the stored capture for the d trajectory) or an in-memory
:class:`~osdn_diag.replay.Results`. Each run becomes one :class:`RunView`:

* aggregates, exact and of every row: the contraction curve over relative position and the layer × head
  q_geo (``summary.json``'s ``position_bins`` and ``by_head``), each head's own curve over the same ten
  position bins (from ``residuals.parquet``), ε_T^diag against q_geo of every stream
  (``comparator.parquet``), fidelity and the assumption audit (``summary.json``);
* token strips for a few prompts only (:data:`DEFAULT_STRIPS` by default, or the ids asked for): per
  position and layer the q_t, loss, β and d statistics of the token, pooled over heads; and pooled
  over every layer too. This is the part whose size grows with the prompts' length, so it is bounded
  by the number of prompts chosen, not by the run's.

Conventions (docs/metrics.md): ``q_geo = exp(mean log max(q, 1e-30))`` over finite rows; a position's
bin is ``floor(10 · pos / length)`` of its prompt; a micro-step family's per-token ratio is its
``token_ratio`` on ``step = 0`` rows (in the strips; the aggregates are per write, as the summary's).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["DEFAULT_STRIPS", "NUM_BINS", "RunView", "StripPrompt", "choose_strip_prompts", "view_data"]

#: How many prompts get a token strip when none are named.
DEFAULT_STRIPS = 4
#: Relative-position bins (summary.json's ``position_bins``).
NUM_BINS = 10
_FLOOR = 1e-30  # osdn_diag.metrics.ratios.Q_FLOOR (not imported: that module imports torch)
#: The per-token quantities of a strip, in the order they are stored.
STRIP_FIELDS = ("q", "loss_before", "loss_after", "beta", "d_key")


@dataclass
class StripPrompt:
    """One prompt's token strip. ``values[f]``: ``float32 [L + 1, T]`` for each of
    :data:`STRIP_FIELDS` — row ``i < L`` the layer ``layers[i]`` pooled over its heads, row ``L`` every
    layer and head pooled; ``NaN`` where no finite row counts. ``q``: the geometric mean of q_t;
    ``loss_before``, ``loss_after``, ``beta``: arithmetic means; ``d_key``: the mean of
    ``write_gain / (beta · key_sqnorm)`` = ⟨d, k⊙k⟩/‖k‖², the write key's preconditioner averaged
    with the key's squared entries as weights (1 without a preconditioner), over rows where
    ``beta · key_sqnorm > 0``."""

    id: int
    task: str
    length: int
    tokens: list[str]
    token_ids: list[int]
    values: dict[str, np.ndarray]


@dataclass
class RunView:
    """One run as the view shows it (see the module's docstring)."""

    label: str
    summary: dict
    layers: list[int]
    heads: int
    #: ``{(layer, head): (q_geo per bin or None, n per bin)}``
    head_curves: dict[tuple[int, int], tuple[list[float | None], list[int]]]
    strips: list[StripPrompt]
    #: ``{"prompt", "layer", "head", "eps", "q"}`` lists, one entry per stream with a valid write; None
    #: without comparator.parquet
    eps: dict | None
    #: ``{"title", "source", "t", "mean", "min", "max"}``: the preconditioner over the first prompt of one
    #: head; None when the run has none
    d: dict | None
    prompts: list[dict] = field(default_factory=list)  # id, task, length of every prompt
    note: str = ""


def _run_parts(run, default_label: str):
    """``(label, summary, manifest or None, run directory or None, table or None)``."""
    if isinstance(run, (str, os.PathLike)):
        from ..replay import load_run
        from ..report.markdown import _label

        manifest, summary = load_run(run)
        return _label(Path(run), manifest), summary, manifest, Path(run), None
    from ..replay import Results  # here, not above: it imports torch, which reading a run never needs

    if isinstance(run, Results):
        return default_label, run.summary, None, None, run
    raise TypeError(f"argument 'runs': expected a run directory or a Results, got {type(run).__name__}")


def _runs(runs, labels):
    from collections.abc import Mapping

    if isinstance(runs, Mapping):
        items = [(str(k), v) for k, v in runs.items()]
    elif isinstance(runs, (list, tuple)):
        items = [(None, r) for r in runs]
    else:
        items = [(None, runs)]
    if not items:
        raise ValueError("argument 'runs': no runs given")
    if labels is not None and len(labels) != len(items):
        raise ValueError(f"argument 'labels': expected {len(items)} labels, got {len(labels)}")
    from ..report.markdown import distinct_labels

    out = []
    for i, (key, run) in enumerate(items):
        label, *rest = _run_parts(run, key or (f"run {i}" if len(items) > 1 else "run"))
        out.append(((labels[i] if labels is not None else key or label), *rest))
    if labels is None and not isinstance(runs, Mapping):  # labels of the runs' own: told apart
        names = distinct_labels([o[0] for o in out], [o[3] for o in out])
        out = [(name, *o[1:]) for name, o in zip(names, out)]
    return out


def _read(table_or_dir, columns, prompts=None) -> pa.Table:
    """Columns of the per-token table (those present), optionally of some prompts only."""
    if isinstance(table_or_dir, pa.Table):
        t = table_or_dir.select([c for c in columns if c in table_or_dir.column_names])
        if prompts is not None:
            t = t.filter(pc.is_in(t.column("prompt"), pa.array(prompts, pa.int32())))
        return t
    from ..replay.runs import read_table, table_columns

    path = table_or_dir / "residuals.parquet"
    names = table_columns(path)
    filters = None if prompts is None else [("prompt", "in", [int(p) for p in prompts])]
    return read_table(path, columns=[c for c in columns if c in names], filters=filters)


def _col(t: pa.Table, name: str) -> np.ndarray:
    return t.column(name).to_numpy(zero_copy_only=False)


def _prompt_info(manifest, table: pa.Table) -> list[dict]:
    """id, task, length of every prompt: from the manifest, or (in memory) from the table."""
    if manifest is not None:
        return [{"id": int(p["id"]), "task": p.get("task", ""), "length": int(p["length"])}
                for p in manifest.get("prompts", [])]
    aggs = [("pos", "max")] + ([("task", "first")] if "task" in table.column_names else [])
    g = table.group_by("prompt", use_threads=False).aggregate(aggs).sort_by("prompt").to_pydict()
    tasks = g.get("task_first", [""] * len(g["prompt"]))
    return [{"id": int(p), "task": t or "", "length": int(m) + 1} for p, t, m in zip(g["prompt"], tasks, g["pos_max"])]


def _head_curves(table: pa.Table, lengths: dict[int, int]) -> dict:
    """``{(layer, head): (q_geo per bin, n per bin)}`` over every finite row, bins as the summary's."""
    layer, head = _col(table, "layer").astype(np.int64), _col(table, "head").astype(np.int64)
    prompt, pos = _col(table, "prompt").astype(np.int64), _col(table, "pos").astype(np.int64)
    q = _col(table, "residual_ratio").astype(np.float64)
    keep = _col(table, "finite").astype(bool)
    top = int(prompt.max()) + 1 if len(prompt) else 0
    length = np.ones(top, np.int64)
    for p, n in lengths.items():
        if p < top:
            length[p] = n
    bins = np.minimum(NUM_BINS * pos // length[prompt], NUM_BINS - 1)  # integers, as the summary's
    nh = int(head.max()) + 1 if len(head) else 1
    nl = int(layer.max()) + 1 if len(layer) else 1
    index = (layer * nh + head) * NUM_BINS + bins
    size = nl * nh * NUM_BINS
    n = np.bincount(index[keep], minlength=size)
    s = np.bincount(index[keep], weights=np.log(np.maximum(q[keep], _FLOOR)), minlength=size)
    present = np.bincount(layer * nh + head, minlength=nl * nh) > 0
    out = {}
    for cell in np.flatnonzero(present):
        lo = cell * NUM_BINS
        nn = n[lo:lo + NUM_BINS]
        geo = [float(math.exp(s[lo + b] / nn[b])) if nn[b] else None for b in range(NUM_BINS)]
        out[(int(cell // nh), int(cell % nh))] = (geo, [int(x) for x in nn])
    return out


def choose_strip_prompts(prompts: list[dict], count: int | None = None, ids=None) -> list[int]:
    """The prompts that get a token strip: ``ids`` as given (each must exist), or ``count`` of them
    taken in turn from each task (the first of every task, then the second, ...), so every task is
    shown; in id order."""
    known = {p["id"] for p in prompts}
    if ids is not None:
        ids = [int(i) for i in ids]
        missing = [i for i in ids if i not in known]
        if missing:
            raise ValueError(f"argument 'strip_prompts' (--strip-prompts): no prompt {missing[0]} in the run (ids "
                             f"{min(known)}–{max(known)})" if known else "argument 'strip_prompts' (--strip-prompts): the run has no prompts")
        return sorted(dict.fromkeys(ids))
    count = DEFAULT_STRIPS if count is None else int(count)
    if count < 0:
        raise ValueError(f"argument 'strips': expected 0 or more prompts, got {count}")
    by_task: dict[str, list[int]] = {}
    for p in prompts:
        by_task.setdefault(p["task"], []).append(p["id"])
    chosen, k = [], 0
    while len(chosen) < min(count, len(known)):
        for ids_ in by_task.values():
            if k < len(ids_) and len(chosen) < count:
                chosen.append(ids_[k])
        k += 1
    return sorted(chosen)


def _strips(source, tokens: pa.Table | None, prompts: list[dict], chosen: list[int]) -> list[StripPrompt]:
    if not chosen:
        return []
    cols = ["prompt", "layer", "head", "pos", "residual_ratio", "finite", "beta", "key_sqnorm", "write_gain",
            "loss_before", "loss_after", "step", "token_ratio"]
    t = _read(source, cols, chosen)
    prompt, layer, pos = (_col(t, c).astype(np.int64) for c in ("prompt", "layer", "pos"))
    keep = _col(t, "finite").astype(bool)
    q = _col(t, "residual_ratio").astype(np.float64)
    if "step" in t.column_names:  # a micro-step family: its token's ratio, once per token
        step = t.column("step")
        micro = step.is_valid().to_numpy(zero_copy_only=False)
        if micro.any():
            keep &= ~micro | (step.fill_null(0).to_numpy(zero_copy_only=False) == 0)
            token = t.column("token_ratio").fill_null(np.nan).to_numpy(zero_copy_only=False).astype(np.float64)
            q = np.where(micro, token, q)
    beta, ksq, gain = (_col(t, c).astype(np.float64) for c in ("beta", "key_sqnorm", "write_gain"))
    denom = beta * ksq
    with np.errstate(invalid="ignore", divide="ignore"):
        dkey = np.where(denom > 0, gain / np.where(denom > 0, denom, 1.0), np.nan)
    layers = sorted(int(x) for x in np.unique(layer))
    nl = len(layers)
    lrank = np.zeros(max(layers, default=0) + 1, np.int64)
    lrank[layers] = np.arange(nl)
    info = {p["id"]: p for p in prompts}
    text = {}
    if tokens is not None:
        tk = tokens.filter(pc.is_in(tokens.column("prompt"), pa.array(chosen, pa.int32())))
        for p, ps, tid, tx in zip(_col(tk, "prompt"), _col(tk, "pos"), _col(tk, "token_id"),
                                  tk.column("text").to_pylist()):
            text[(int(p), int(ps))] = (int(tid), tx)
    out = []
    for pid in chosen:
        T = int(info[pid]["length"])
        sel = prompt == pid
        li = lrank[layer[sel]]
        ps, k = pos[sel], keep[sel]
        values = {}
        for name, x, geo in (("q", q, True), ("loss_before", _col(t, "loss_before").astype(np.float64), False),
                             ("loss_after", _col(t, "loss_after").astype(np.float64), False),
                             ("beta", beta, False), ("d_key", dkey, False)):
            x = x[sel]
            ok = k & np.isfinite(x) if name == "d_key" else k
            v = np.log(np.maximum(x, _FLOOR)) if geo else x
            v = np.where(ok, v, 0.0)
            grid = np.full((nl + 1, T), np.nan)
            for rows, idx in ((li * T + ps, slice(0, nl)), (ps, nl)):
                size = (nl if idx != nl else 1) * T
                n = np.bincount(rows, weights=ok, minlength=size)
                s = np.bincount(rows, weights=v, minlength=size)
                with np.errstate(invalid="ignore", divide="ignore"):
                    mean = np.where(n > 0, s / np.where(n > 0, n, 1), np.nan)
                grid[idx] = (np.exp(mean) if geo else mean).reshape(-1, T)
            values[name] = grid.astype(np.float32)
        ids, pieces = [], []
        for i in range(T):
            tid, tx = text.get((pid, i), (None, None))
            ids.append(-1 if tid is None else tid)
            pieces.append(tx if tx is not None else (f"[{tid}]" if tid is not None else "·"))
        out.append(StripPrompt(pid, info[pid]["task"], T, pieces, ids, values))
    return out


def _eps(run_dir: Path | None, manifest) -> dict | None:
    """Every stream's ε_T^diag and q_geo (``exp(log_prod_q / n_valid)``, streams with a valid write),
    with its layer, head and prompt; None without comparator.parquet or for a run all of whose layers
    are of a family Theorem D.7's comparator does not describe (the report leaves those out too)."""
    if run_dir is None or not (run_dir / "comparator.parquet").is_file():
        return None
    from ..replay.families import NOT_APPLICABLE

    fams = {layer.get("family") for layer in (manifest or {}).get("layers", [])}
    if fams and fams <= set(NOT_APPLICABLE):
        return None
    from ..replay.runs import read_table

    t = read_table(run_dir / "comparator.parquet", columns=["prompt", "layer", "head", "eps_diag",
                                                              "log_prod_q", "n_valid"])
    n = _col(t, "n_valid")
    ok = n > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.exp(_col(t, "log_prod_q") / np.where(ok, n, 1))
    return {"prompt": _col(t, "prompt")[ok].astype(int).tolist(), "layer": _col(t, "layer")[ok].astype(int).tolist(),
            "head": _col(t, "head")[ok].astype(int).tolist(), "eps": _col(t, "eps_diag")[ok].astype(float).tolist(),
            "q": q[ok].astype(float).tolist()}


def _d(label: str, run_dir: Path | None, manifest, source, prompts: list[dict]) -> dict | None:
    """The preconditioner over the first prompt of head 0 of the first layer with a d: from the stored
    capture (mean, min and max over its K channels, as the report's d plot reads it), else — a
    ``--stream`` run, or in memory — the key-weighted mean ⟨d, k⊙k⟩/‖k‖² from the per-token table
    (the ``d_key`` of the strips). None for a run without a d."""
    if manifest is not None:
        with_d = [layer["layer"] for layer in manifest.get("layers", []) if layer.get("has_d")]
        if not with_d and not manifest.get("counterfactual"):
            return None
        from ..report.markdown import d_trajectory_of

        found = d_trajectory_of([run_dir], [label], [manifest], None)
        if found is not None:
            d, title = found
            d = np.asarray(d, dtype=np.float64)
            return {"title": title, "source": "capture", "t": list(range(d.shape[0])),
                    "mean": d.mean(1).tolist(), "min": d.min(1).tolist(), "max": d.max(1).tolist()}
        if not with_d:
            return None
        layer0 = min(with_d)
    else:
        layer0 = None
    if not prompts:
        return None
    pid = prompts[0]["id"]
    t = _read(source, ["prompt", "layer", "head", "pos", "beta", "key_sqnorm", "write_gain", "finite"], [pid])
    layer, head = _col(t, "layer").astype(int), _col(t, "head").astype(int)
    beta, ksq, gain = (_col(t, c).astype(np.float64) for c in ("beta", "key_sqnorm", "write_gain"))
    denom = beta * ksq
    ok = (denom > 0) & _col(t, "finite").astype(bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        dkey = gain / np.where(ok, denom, 1.0)
    if layer0 is None:  # in memory: the first layer whose d differs from 1 anywhere
        moved = sorted(set(layer[ok & (np.abs(dkey - 1.0) > 1e-6)].tolist()))
        if not moved:
            return None
        layer0 = moved[0]
    sel = (layer == layer0) & (head == 0)
    pos = _col(t, "pos")[sel].astype(int)
    order = np.argsort(pos)
    vals = np.where(ok[sel], dkey[sel], np.nan)[order]
    clean = [None if not np.isfinite(v) else float(v) for v in vals]
    return {"title": f"{label}: layer {layer0}, head 0, prompt {pid}", "source": "table",
            "t": pos[order].tolist(), "mean": clean, "min": None, "max": None}


def view_data(runs, labels=None, *, strips: int | None = None, strip_prompts=None) -> list[RunView]:
    """One :class:`RunView` per run. ``runs``: a run directory, a :class:`~osdn_diag.replay.Results`,
    a list of them, or a ``{label: run}`` mapping; ``labels``: one per run (default: the model spec,
    as the report's). Token strips for ``strip_prompts`` (prompt ids) or else ``strips`` prompts
    (:data:`DEFAULT_STRIPS`) chosen by :func:`choose_strip_prompts` from the first run's prompts —
    the same ids in every run, so runs on the same prompts line up."""
    from ..replay.tokens import read_tokens

    parts = _runs(runs, labels)
    out, chosen = [], None
    for label, summary, manifest, run_dir, results in parts:
        source = run_dir if run_dir is not None else results.table
        table = _read(source, ["prompt", "task", "layer", "head", "pos", "residual_ratio", "finite"])
        prompts = _prompt_info(manifest, table)
        if chosen is None:
            chosen = choose_strip_prompts(prompts, strips, strip_prompts)
        lengths = {p["id"]: p["length"] for p in prompts}
        curves = _head_curves(table, lengths)
        del table
        tokens = read_tokens(run_dir, manifest) if run_dir is not None else results.tokens
        mine = [i for i in chosen if i in lengths]
        layers = sorted({k[0] for k in curves})
        heads = max((k[1] for k in curves), default=-1) + 1
        note = "" if tokens is not None else "no token text (tokens.parquet missing): positions only"
        out.append(RunView(label=label, summary=summary, layers=layers, heads=heads, head_curves=curves,
                           strips=_strips(source, tokens, prompts, mine), eps=_eps(run_dir, manifest),
                           d=_d(label, run_dir, manifest, source, prompts), prompts=prompts, note=note))
    return out
