"""The run's tokens (``tokens.parquet``) and the per-token view of the residual ratios.

``tokens.parquet`` has one row per (prompt, position): the token id and, where the model has a
tokenizer, its text (:class:`osdn_diag.prompts.text.TokenText`; null without one). It is written with
the capture, from the ids the model read, and joins ``residuals.parquet`` on ``(prompt, pos)``.

:func:`per_token` reduces ``residuals.parquet`` to one row per (prompt, position) — or per (prompt,
layer, position) — with the geometric mean of the token's ratios over heads (and layers), as the summary
computes q_geo (docs/metrics.md): over finite rows, ``exp(mean log max(q, 1e-30))``, a micro-step
family's ``token_ratio`` on its ``step = 0`` rows. :func:`token_stats` then pools a run's positions by
token id, the report's table of the tokens whose writes contract least and most.

No torch here: the report reads these.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401 - pa.compute

from .runs import read_table, table_columns

__all__ = ["MIN_COUNT", "NO_TOKENIZER", "TOKENS", "TOKENS_SCHEMA", "per_token", "read_tokens", "token_stats",
           "token_table", "tokens_entry", "write_tokens"]

TOKENS = "tokens.parquet"
TOKENS_SCHEMA = pa.schema([("prompt", pa.int32()), ("pos", pa.int32()), ("token_id", pa.int32()),
                           ("text", pa.string())])
#: The report lists a token only where it occurs at this many positions of the run's prompts or more.
MIN_COUNT = 5
_FLOOR = 1e-30  # osdn_diag.metrics.ratios.Q_FLOOR (not imported: that module imports torch)
_RUN_ID_KEY = b"osdn_diag.run_id"  # osdn_diag.rundir.RUN_ID_KEY


def token_table(ids_by_prompt: Mapping[int, Sequence[int]] | Iterable[tuple[int, Sequence[int]]],
                text: Callable[[Sequence[int]], list[str]] | None = None) -> pa.Table:
    """The rows of ``tokens.parquet``: ``(prompt, pos, token_id, text)`` for every prompt's ids, in
    prompt order; ``text`` (e.g. a :class:`~osdn_diag.prompts.text.TokenText`) gives each id's piece,
    null without one. Ids appended to a prompt after it was read (generated ones) go in the same list."""
    items = sorted(ids_by_prompt.items() if isinstance(ids_by_prompt, Mapping) else ids_by_prompt)
    prompt, pos, token_id, pieces = [], [], [], []
    for p, ids in items:
        ids = [int(i) for i in ids]
        prompt.append(np.full(len(ids), p, dtype=np.int32))
        pos.append(np.arange(len(ids), dtype=np.int32))
        token_id.append(np.asarray(ids, dtype=np.int32))
        pieces += text(ids) if text is not None else [None] * len(ids)
    cat = (lambda a: np.concatenate(a) if a else np.zeros(0, np.int32))
    return pa.table([cat(prompt), cat(pos), cat(token_id), pa.array(pieces, pa.string())], schema=TOKENS_SCHEMA)


def write_tokens(out_dir: str | os.PathLike, table: pa.Table, run_id: str | None) -> dict:
    """Write ``table`` to ``out_dir/tokens.parquet`` (atomically, ``run_id`` in its schema metadata);
    returns ``{"sha256", "size", "rows"}`` for the manifest."""
    import pyarrow.parquet as pq

    from ..runtime.atomic import atomic_path
    from ..rundir import sha256_file

    path = Path(out_dir) / TOKENS
    if run_id is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), _RUN_ID_KEY: run_id})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, use_dictionary=["text"])
    return {"sha256": sha256_file(path), "size": path.stat().st_size, "rows": table.num_rows}


#: The ``tokens`` entry's note where the model directory has no tokenizer.
NO_TOKENIZER = "the model has no tokenizer: token ids only"


def tokens_entry(file: dict, text: dict | None, unreadable: str | None = None) -> dict:
    """The manifest's ``tokens`` entry: the file (``write_tokens``'s answer) and ``text``, the tokenizer
    (:attr:`TokenText.info`) or ``None`` where the model has none — or has one that could not be
    loaded, ``unreadable`` saying why (recorded in the note)."""
    note = (NO_TOKENIZER if unreadable is None
            else f"the model's tokenizer could not be loaded: token ids only ({unreadable})")
    return {"file": TOKENS, **file, "text": text is not None, "tokenizer": text,
            **({} if text is not None else {"note": note})}


def read_tokens(run_dir: str | os.PathLike, manifest: dict | None = None) -> pa.Table | None:
    """A run's ``tokens.parquet``, or ``None`` where it has none (a run written before it existed).
    One whose run id is not the manifest's (given ``manifest``), or that is missing or differs from the
    sha256 and size the manifest's ``tokens`` entry records, is refused."""
    from ..rundir import check_regular, verify_files

    path = Path(run_dir) / TOKENS
    check_regular(path)
    entry = (manifest or {}).get("tokens")
    if isinstance(entry, dict) and "sha256" in entry:
        # The file the capture wrote, or the report's token text would be whatever the file now says.
        problem = verify_files(run_dir, {TOKENS: entry})
        if problem is not None:
            raise ValueError(f"{problem.replace('its record says', 'manifest.json records')}: tokens.parquet is "
                             "not the one the run wrote; run it again")
    if not path.is_file():
        return None
    table = read_table(path)
    found = (table.schema.metadata or {}).get(_RUN_ID_KEY)
    want = None if manifest is None else (manifest.get("source_run_id") if manifest.get("counterfactual")
                                         else manifest.get("run_id"))
    if want is not None and found is not None and found.decode() != want:
        raise ValueError(f"{path}: written by run {found.decode()}, not by this run ({want}); run it again")
    return table


def _ratio_columns(residuals) -> dict[str, np.ndarray]:
    """``prompt, layer, pos`` of every row, ``q`` its ratio and ``keep`` whether it counts per token
    (finite; of a micro-step family only the step-0 rows, ``q`` their ``token_ratio``), from a table or
    a ``residuals.parquet`` path. Nothing is copied that need not be (18.9 M rows at paper scale)."""
    if not isinstance(residuals, pa.Table):
        names = table_columns(residuals)
        wanted = ["prompt", "layer", "pos", "residual_ratio", "finite"]
        residuals = read_table(residuals, columns=wanted + [c for c in ("step", "token_ratio") if c in names])
    col = (lambda n: residuals.column(n).to_numpy(zero_copy_only=False))
    keep = col("finite").astype(bool, copy=False)
    q = col("residual_ratio")
    if "step" in residuals.column_names:
        step = residuals.column("step")
        micro = step.is_valid().to_numpy(zero_copy_only=False)
        if micro.any():
            keep = keep & (~micro | (step.fill_null(0).to_numpy(zero_copy_only=False) == 0))
            token = residuals.column("token_ratio").fill_null(np.nan).to_numpy(zero_copy_only=False)
            q = np.where(micro, token.astype(np.float64), q.astype(np.float64))
    return {"prompt": col("prompt"), "layer": col("layer"), "pos": col("pos"), "q": q,
            "keep": None if keep.all() else keep}


def _cells(residuals, tokens: pa.Table | None, by_layer: bool) -> dict:
    """The sums of :func:`per_token` per cell (prompt, [layer,] pos), cells in row order: every
    position of ``tokens`` and every one with a row in ``residuals``. The rows are indexed on a dense
    grid (prompt, [layer,] position up to the longest prompt) and summed with ``np.bincount``; cells of
    the grid that neither table has are then dropped."""
    c = _ratio_columns(residuals)
    t_prompt = t_pos = None
    if tokens is not None:
        t_prompt = tokens.column("prompt").to_numpy()
        t_pos = tokens.column("pos").to_numpy()
    top = max([int(a.max()) + 1 for a in (c["prompt"], t_prompt) if a is not None and len(a)], default=0)
    present = np.zeros(top, dtype=bool)
    for a in (c["prompt"], t_prompt):
        if a is not None and len(a):
            present |= np.bincount(a, minlength=top) > 0
    prompts = np.flatnonzero(present)
    rank = np.cumsum(present) - 1  # prompt id -> its place among the prompts
    width = max([int(a.max()) + 1 for a in (c["pos"], t_pos) if a is not None and len(a)], default=0)
    layers = np.flatnonzero(np.bincount(c["layer"])) if by_layer else np.zeros(1, np.int64)
    nl = len(layers)
    index = rank[c["prompt"]].astype(np.int64) * width + c["pos"]
    if by_layer:
        lrank = np.zeros(int(layers.max()) + 1 if nl else 1, dtype=np.int64)
        lrank[layers] = np.arange(nl)
        index = index * nl + lrank[c["layer"]]
    size = len(prompts) * width * nl
    q = c["q"].astype(np.float64)
    log_q = np.log(np.maximum(q, _FLOOR))
    keep = c["keep"]
    rows = np.bincount(index, minlength=size)
    if keep is None:
        n = rows
    else:
        n = np.bincount(index, weights=keep, minlength=size).astype(np.int64)
        log_q, q = np.where(keep, log_q, 0.0), np.where(keep, q, 0.0)
    sum_log = np.bincount(index, weights=log_q, minlength=size)
    sum_q = np.bincount(index, weights=q, minlength=size)
    # position -> row of tokens (-1: none), on the grid without layers
    row = np.full(len(prompts) * width, -1, dtype=np.int64)
    if tokens is not None:
        row[rank[t_prompt].astype(np.int64) * width + t_pos] = np.arange(len(t_prompt))
    row = row.repeat(nl)
    cell = (rows > 0) | (row >= 0)
    grid_prompt = np.repeat(prompts, width * nl)
    grid_pos = np.tile(np.arange(width).repeat(nl), len(prompts))
    grid_layer = np.tile(layers, len(prompts) * width)
    return {"prompt": grid_prompt[cell], "layer": grid_layer[cell], "pos": grid_pos[cell],
            "token_row": row[cell], "n": n[cell], "sum_log": sum_log[cell], "sum_q": sum_q[cell]}


def _token_column(tokens: pa.Table | None, rows: np.ndarray, name: str, type_: pa.DataType) -> pa.Array:
    """``tokens[name]`` at ``rows`` (null where a row is -1, or without ``tokens``)."""
    if tokens is None:
        return pa.nulls(len(rows), type_)
    known = rows >= 0
    taken = tokens.column(name).combine_chunks().take(pa.array(np.where(known, rows, 0)))
    return pa.compute.if_else(pa.array(known), taken, pa.nulls(len(rows), type_))


def per_token(residuals, tokens: pa.Table | None = None, *, by_layer: bool = False) -> pa.Table:
    """One row per (prompt, pos) — with ``by_layer``, per (prompt, layer, pos) — of ``residuals`` (a
    table or a path to ``residuals.parquet``): ``token_id`` and ``text`` from ``tokens`` (null where it
    has no row, or without it), ``q_geo`` (``exp(mean log max(q, 1e-30))``) and ``q_arith`` of the
    token's finite ratios over heads (and layers), ``n`` how many there were (0: none, and then
    ``q_geo`` and ``q_arith`` are null). Rows come sorted by prompt, then pos (then layer, with
    ``by_layer``: a token's layers are adjacent); every position of
    ``tokens`` is there, and every one of ``residuals``."""
    c = _cells(residuals, tokens, by_layer)
    n = c["n"]
    has = n > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        q_geo = np.exp(c["sum_log"] / n)
        q_arith = c["sum_q"] / n
    columns = {"prompt": pa.array(c["prompt"].astype(np.int32))}
    if by_layer:
        columns["layer"] = pa.array(c["layer"].astype(np.int16))
    columns.update({
        "pos": pa.array(c["pos"].astype(np.int32)),
        "token_id": _token_column(tokens, c["token_row"], "token_id", pa.int32()),
        "text": _token_column(tokens, c["token_row"], "text", pa.string()),
        "q_geo": pa.array(q_geo, mask=~has),
        "q_arith": pa.array(q_arith, mask=~has),
        "n": pa.array(n.astype(np.int64)),
    })
    return pa.table(columns)


def token_stats(residuals, tokens: pa.Table) -> list[dict]:
    """A run's ratios pooled by token id: per id that occurs at a position with a finite ratio,
    ``{"token_id", "text", "count" (positions), "n" (ratios), "q_geo"}``, q_geo over every finite
    ratio at its positions (every layer and head), sorted by q_geo, then id."""
    c = _cells(residuals, tokens, False)
    keep = (c["n"] > 0) & (c["token_row"] >= 0)
    rows = c["token_row"][keep]
    if not len(rows):
        return []
    ids = tokens.column("token_id").to_numpy().astype(np.int64)[rows]
    uniq, first, inv = np.unique(ids, return_index=True, return_inverse=True)
    count = np.bincount(inv)
    n = np.bincount(inv, weights=c["n"][keep])
    sum_log = np.bincount(inv, weights=c["sum_log"][keep])
    text = tokens.column("text").take(pa.array(rows[first])).to_pylist()
    out = [{"token_id": int(u), "text": t, "count": int(k), "n": int(m), "q_geo": float(np.exp(s / m))}
           for u, t, k, m, s in zip(uniq, text, count, n, sum_log)]
    out.sort(key=lambda r: (r["q_geo"], r["token_id"]))
    return out
