"""How ``residuals.parquet`` is encoded: dictionary pages only for the task names (where strings repeat);
the integer and float columns plain, which costs a few percent of the file and saves an eighth of the
encoding's time (benchmarks/bench_table_encoding.py). The values read back are the same either way."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from osdn_diag.pipeline.writers import _ParquetEncoder
from osdn_diag.replay.replayer import _arrow_table, _schema


def test_only_the_task_names_are_dictionary_encoded(tmp_path, benchmark_script):
    bench = benchmark_script("bench_table_encoding")
    schema = _schema(pa.float32())
    prompts = {0: {"task": "lm-heldout", "repeat_start": -1}, 1: {"task": "mqar", "repeat_start": 8}}
    table = _arrow_table([0, 1], 3, bench.host_columns(2, 16, 2, seed=0), [16, 16], prompts, schema, "float32")
    path = tmp_path / "residuals.parquet"
    encoder = _ParquetEncoder(str(path), schema, path)
    encoder.write(table)
    encoder.close()
    meta = pq.ParquetFile(path).metadata.row_group(0)
    dictionary = {meta.column(i).path_in_schema for i in range(meta.num_columns)
                  if "PLAIN_DICTIONARY" in meta.column(i).encodings or "RLE_DICTIONARY" in meta.column(i).encodings}
    assert dictionary == {"task"}
    back = pq.read_table(path)
    assert back.equals(table.select(back.column_names))  # less the columns no layer filled
    assert back["task"].to_pylist()[:1] == ["lm-heldout"] and back["task"].to_pylist()[-1] == "mqar"
    assert np.array_equal(back["head"].to_numpy(), table["head"].to_numpy())


def test_the_benchmark_counts_every_row_and_every_column_group(benchmark_script, tmp_path):
    bench = benchmark_script("bench_table_encoding")
    result = bench.main(["--calls", "3", "--prompts", "2", "--T", "32", "--H", "2", "--json", str(tmp_path / "r.json")])
    assert result["rows"] == 3 * 2 * 32 * 2
    groups = result["encode_by_group_cpu_s"]
    assert len(groups) == 3 and all(v >= 0 for v in groups.values())
    # the file's columns: a DeltaNet run's, which the groups (labels, positions, measurements) cover once
    from osdn_diag.replay.replayer import optional_columns

    assert len(result["columns"]) == 15 and not set(result["columns"]) & set(optional_columns())
    assert result["encode_every_column_cpu_s"] > 0 and result["bytes_every_column"] > 0
    assert (tmp_path / "r.json").is_file()
