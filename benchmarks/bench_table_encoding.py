"""The per-token table's host cost at paper scale: building each replayed call's rows and encoding them
into ``residuals.parquet`` with the run's own writer settings, and which columns the encoding's time
goes to (CPU only; no model, no GPU).

    python benchmarks/bench_table_encoding.py [--calls 144] [--prompts 8] [--T 2048] [--H 8] [--json FILE]

The default is the paper-scale stream run of ``random:deltanet-340m``: 48 prompts of 2,048 tokens in
batches of 8, 24 layers, 8 heads, so 144 calls of 131,072 rows (18.9 M rows). Each call's host columns
(what ``replay_call`` hands the writer: six fp32 measurements and the sequence, head, pos and finite
columns) are made with numpy, with values of the measurements' own spread, and go through the
package's :func:`~osdn_diag.replay.replayer._arrow_table` and a ``ParquetWriter`` with the encoder's
dictionary columns and the columns a DeltaNet run fills, one thread, as ``run --stream`` writes them.
Reported: the CPU seconds of building and of encoding the whole table, of encoding each group of
columns on its own, and, as the baseline, of encoding every registered column (the other kernel
families' own columns and a decay's, null throughout a DeltaNet run), as runs wrote them before they
left those out.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from _common import write_json

from osdn_diag.pipeline.writers import _ParquetEncoder
from osdn_diag.replay.replayer import _arrow_table, _schema, filled_schema

MEASUREMENTS = ("beta", "key_sqnorm", "write_gain", "loss_before", "loss_after", "residual_ratio")
#: The columns that label each row (the same value over many rows).
LABELS = ("prompt", "task", "layer", "head", "repeat_start", "decode_start", "finite")


def host_columns(prompts: int, T: int, H: int, seed: int) -> dict:
    """One call's host columns in the replay's row order (sequence, head, pos): CPU tensors, as
    ``replay_call`` hands them to ``_arrow_table``."""
    rng = np.random.default_rng(seed)
    n = prompts * H * T
    before = rng.exponential(size=n).astype(np.float32)
    ratio = rng.beta(2.0, 5.0, size=n).astype(np.float32)

    cols = {
        "sequence": np.repeat(np.arange(prompts, dtype=np.int32), H * T),
        "head": np.tile(np.repeat(np.arange(H, dtype=np.int32), T), prompts),
        "pos": np.tile(np.arange(T, dtype=np.int32), prompts * H),
        "finite": np.ones(n, dtype=bool),
        "beta": rng.random(n, dtype=np.float32), "key_sqnorm": np.ones(n, dtype=np.float32),
        "write_gain": rng.random(n, dtype=np.float32), "loss_before": before,
        "loss_after": before * ratio, "residual_ratio": ratio,
    }
    return {k: torch.from_numpy(v) for k, v in cols.items()}


def encode_seconds(tables: list[pa.Table], calls: int, columns: list[str] | None = None) -> tuple[float, int]:
    """CPU seconds and bytes of encoding ``calls`` tables (``tables`` in turn) with the run's writer
    settings; ``columns``: only these."""
    if columns is not None:
        tables = [t.select(columns) for t in tables]
    dictionary = [c for c in _ParquetEncoder.DICTIONARY_COLUMNS if c in tables[0].column_names]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.parquet")
        start = time.process_time()
        writer = pq.ParquetWriter(path, tables[0].schema, use_dictionary=dictionary)
        for i in range(calls):
            writer.write_table(tables[i % len(tables)])
        writer.close()
        return time.process_time() - start, os.path.getsize(path)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=144, help="replayed calls (paper scale: 6 batches × 24 layers)")
    p.add_argument("--prompts", type=int, default=8, help="sequences per call (the batch size)")
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    schema = _schema(pa.float32())
    prompts = {i: {"task": "lm-heldout", "repeat_start": -1} for i in range(a.prompts)}
    variants = [host_columns(a.prompts, a.T, a.H, seed) for seed in range(4)]

    def rows_of(i: int) -> pa.Table:
        return _arrow_table(list(range(a.prompts)), i % 24, variants[i % 4], [a.T] * a.prompts, prompts,
                            schema, "float32")

    # As the run does it: each call's rows built, encoded and let go (keeping every call's table alive
    # would time the allocator, not the work). The file holds the columns the run's layers fill
    # (filled_schema); the baseline encodes every registered column, as runs did before, in turn.
    columns = filled_schema(schema, [rows_of(0)])
    build = whole = every = 0.0
    rows = size = every_size = 0
    for file_schema in (columns, schema):
        spent = 0.0
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t.parquet")
            writer = pq.ParquetWriter(path, file_schema, use_dictionary=_ParquetEncoder.DICTIONARY_COLUMNS)
            for i in range(a.calls):
                t0 = time.process_time()
                table = rows_of(i)
                t1 = time.process_time()
                writer.write_table(table.select(file_schema.names))
                t2 = time.process_time()
                spent += t2 - t1
                if file_schema is columns:
                    build, rows = build + t1 - t0, rows + table.num_rows
            writer.close()
            if file_schema is columns:
                whole, size = spent, os.path.getsize(path)
            else:
                every, every_size = spent, os.path.getsize(path)
    tables = [rows_of(i) for i in range(4)]  # encoded in turn, by column group
    groups = {
        "labels (" + ", ".join(LABELS) + ")": list(LABELS),
        "pos, rel_pos": ["pos", "rel_pos"],
        "the six measurements": list(MEASUREMENTS),
    }
    parts = {name: encode_seconds(tables, a.calls, cols)[0] for name, cols in groups.items()}
    print(f"per-token table: {a.calls} calls × {rows // a.calls:,} rows = {rows:,} rows; "
          f"{platform.machine()}, {os.cpu_count()} CPUs, pyarrow {pa.__version__}")
    print(f"{'stage':62s} {'CPU s':>7s}")
    print(f"{'building the rows (_arrow_table)':62s} {build:7.2f}")
    print(f"{'encoding them (one thread), ' + format(size / 1e9, '.2f') + f' GB, {len(columns)} columns':62s} {whole:7.2f}")
    for name, seconds in parts.items():
        print(f"{'  of which ' + name:62s} {seconds:7.2f}  ({seconds / whole:.0%})")
    print(f"{'baseline: every registered column (' + str(len(schema)) + '), ' + format(every_size / 1e9, '.2f') + ' GB':62s} "
          f"{every:7.2f}  (encoding ×{every / whole:.2f} of the run's)")
    result = {"calls": a.calls, "rows": rows, "build_cpu_s": build, "encode_cpu_s": whole, "bytes": size,
              "columns": columns.names, "encode_every_column_cpu_s": every, "bytes_every_column": every_size,
              "encode_by_group_cpu_s": parts, "pyarrow": pa.__version__, "machine": platform.machine(),
              "cpus": os.cpu_count()}
    write_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
