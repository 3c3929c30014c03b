"""Run-directory pipeline: capture directory → ``residuals.parquet`` + ``summary.json``.

The per-token table has one row per (prompt, layer, head, position) with the columns of the
interface contract (DESIGN.md): ``prompt, task, layer, head, pos, rel_pos, repeat_start, beta,
key_sqnorm, write_gain, loss_before, loss_after, residual_ratio``, plus ``loss_before_decayed`` and
``residual_ratio_post`` (null for ungated layers) and ``finite``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from .capture.store import CaptureReader, atomic_write_text, to_device
from .metrics.ratios import RatioAccumulator
from .replay import DEFAULT_TOLERANCE, replay_call

__all__ = ["RESIDUALS", "SUMMARY", "replay_run"]

RESIDUALS = "residuals.parquet"
SUMMARY = "summary.json"

_VALUE_COLUMNS = ("beta", "key_sqnorm", "write_gain", "loss_before", "loss_after", "residual_ratio")
_GATED_COLUMNS = ("loss_before_decayed", "residual_ratio_post")


def _schema(value_type: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            ("prompt", pa.int32()),
            ("task", pa.string()),
            ("layer", pa.int16()),
            ("head", pa.int16()),
            ("pos", pa.int32()),
            ("rel_pos", pa.float32()),
            ("repeat_start", pa.int32()),
            *[(c, value_type) for c in _VALUE_COLUMNS + _GATED_COLUMNS],
            ("finite", pa.bool_()),
        ]
    )


def _progress(iterable, total: int, enabled: bool, desc: str):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="call")


def replay_run(
    run_dir: str | os.PathLike,
    *,
    backend: str = "torch",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    tolerance: float | None = None,
    progress: bool = True,
) -> dict:
    """Replay every captured call of ``run_dir`` and write ``residuals.parquet`` and ``summary.json``.

    Args:
        run_dir: a complete capture directory (``manifest.json`` with ``"complete": true``).
        backend: ``"torch"`` or ``"triton"`` (see :func:`osdn_diag.replay.replay_call`).
        dtype: replay precision (fp32 or fp64).
        device: where to replay; default CUDA when available, else CPU.
        tolerance: fidelity tolerance (default per input dtype).
        progress: show a progress bar.

    Returns the summary dictionary that was written to ``summary.json``.
    """
    run_dir = Path(run_dir)
    reader = CaptureReader(run_dir)
    prompts = {int(p["id"]): p for p in reader.manifest.get("prompts", [])}
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    value_type = pa.float64() if dtype == torch.float64 else pa.float32()
    np_dtype = "float64" if dtype == torch.float64 else "float32"
    schema = _schema(value_type)

    ratios, post = RatioAccumulator("residual_ratio"), RatioAccumulator("residual_ratio_post")
    fidelity: dict[int, float] = defaultdict(float)
    nonfinite: dict[int, int] = defaultdict(int)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{RESIDUALS}.", suffix=".tmp")
    os.close(fd)
    try:
        with pq.ParquetWriter(tmp, schema) as writer:
            shards = reader.shards()
            for path in _progress(shards, len(shards), progress, "replay"):
                stored = reader.load(path)
                call = to_device(stored.call, device)
                res = replay_call(call, backend=backend, dtype=dtype, tolerance=tolerance)
                fidelity[call.layer] = max(fidelity[call.layer], res.fidelity)
                nonfinite[call.layer] += res.nonfinite
                tasks = [str(prompts.get(p, {}).get("task", "")) for p in stored.prompts]
                ratios.add(call.layer, res.columns, tasks)
                post.add(call.layer, res.columns, tasks)
                writer.write_table(_arrow_table(stored, res, prompts, schema, np_dtype))
        os.replace(tmp, run_dir / RESIDUALS)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

    summary = ratios.summary()
    if post.cells:
        summary["post_decay"] = post.summary()
    input_dtypes = {layer["input_dtype"] for layer in reader.manifest.get("layers", [])}
    summary["fidelity"] = {
        "max_rel_error": max(fidelity.values(), default=0.0),
        "by_layer": {f"{k:03d}": v for k, v in sorted(fidelity.items())},
        "tolerance": tolerance
        if tolerance is not None
        else {d: DEFAULT_TOLERANCE.get(d, 1e-2) for d in sorted(input_dtypes)},
    }
    summary["nonfinite_heads_by_layer"] = {f"{k:03d}": v for k, v in sorted(nonfinite.items()) if v}
    summary["replay"] = {"backend": backend, "dtype": str(dtype).removeprefix("torch."),
                         "device": str(device)}
    atomic_write_text(run_dir / SUMMARY, json.dumps(summary, indent=2))
    return summary


def _arrow_table(stored, res, prompts: dict, schema: pa.Schema, np_dtype: str) -> pa.Table:
    """The rows of one replayed call; sequence ``i`` of the call is prompt ``stored.prompts[i]``."""
    cols = res.columns
    seq = cols["sequence"].numpy()
    info = [prompts.get(int(p), {}) for p in stored.prompts]
    per_seq = {
        "prompt": np.asarray(stored.prompts, dtype=np.int32),
        "task": np.asarray([str(i.get("task", "")) for i in info], dtype=object),
        "repeat_start": np.asarray([int(i.get("repeat_start", -1)) for i in info], dtype=np.int32),
        "length": np.asarray(res.sequence_lengths, dtype=np.float32),
    }
    pos = cols["pos"].numpy()
    n = len(seq)
    data = {
        "prompt": per_seq["prompt"][seq],
        "task": per_seq["task"][seq],
        "layer": np.full(n, stored.call.layer, dtype=np.int16),
        "head": cols["head"].numpy().astype(np.int16),
        "pos": pos,
        "rel_pos": pos / per_seq["length"][seq],
        "repeat_start": per_seq["repeat_start"][seq],
        "finite": cols["finite"].numpy(),
    }
    arrays = []
    for f in schema:
        if f.name in data:
            arrays.append(pa.array(data[f.name], f.type))
        elif f.name in cols:
            arrays.append(pa.array(cols[f.name].numpy().astype(np_dtype), f.type))
        else:
            arrays.append(pa.nulls(n, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)
