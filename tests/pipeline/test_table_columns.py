"""Which columns ``residuals.parquet`` holds: every column of the contract, and of the columns only some
layers fill (a decay's, a kernel family's own) those that the run's layers fill — decided on the first
forward pass, whose tables the writer holds until a layer comes again. The rows are the calls' rows in
the order they came, value for value; a later call that fills a column left out is refused, naming
its layer, and nothing takes the table's name."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from osdn_diag.distributed import Ranks
from osdn_diag.pipeline.writers import _ParquetEncoder, _residuals_writer
from osdn_diag.replay.replayer import _arrow_table, _schema, filled_schema, optional_columns
from osdn_diag.replay.runs import CONTRACT_COLUMNS

SCHEMA = _schema(pa.float32())
DECAY = ("loss_before_decayed", "residual_ratio_post")
PROMPTS = {0: {"task": "lm-heldout", "repeat_start": -1}, 1: {"task": "mqar", "repeat_start": 4}}


def _rows(layer: int, seed: int, extra: tuple[str, ...] = (), T: int = 6, H: int = 2) -> pa.Table:
    """One call's rows (2 sequences of T tokens, H heads) as the replay builds them; ``extra``: further
    columns the call's replay filled."""
    rng = np.random.default_rng(seed)
    n = 2 * H * T
    cols = {"sequence": np.repeat(np.arange(2, dtype=np.int32), H * T),
            "head": np.tile(np.repeat(np.arange(H, dtype=np.int32), T), 2),
            "pos": np.tile(np.arange(T, dtype=np.int32), 2 * H), "finite": np.ones(n, dtype=bool)}
    for name in ("beta", "key_sqnorm", "write_gain", "loss_before", "loss_after", "residual_ratio", *extra):
        cols[name] = rng.random(n, dtype=np.float32)
    if "step" in extra:
        cols["step"] = np.zeros(n, dtype=np.float32)
    cols = {k: torch.from_numpy(v) for k, v in cols.items()}
    return _arrow_table([0, 1], layer, cols, [T, T], PROMPTS, SCHEMA, "float32")


def _encode(path, tables) -> None:
    encoder = _ParquetEncoder(str(path), SCHEMA, path)
    for i, table in enumerate(tables):
        encoder.write(table if i % 2 else (lambda t=table: t))  # tables and builders, as runs give them
    encoder.close()


def _optional(names) -> set[str]:
    return set(names) & set(optional_columns())


def test_filled_schema_keeps_the_contract_and_the_optional_columns_some_row_fills():
    plain, decayed = _rows(0, 0), _rows(1, 1, DECAY)
    assert _optional(filled_schema(SCHEMA, [plain]).names) == set()
    assert _optional(filled_schema(SCHEMA, [plain, decayed]).names) == set(DECAY)
    empty = filled_schema(SCHEMA, [])
    assert set(CONTRACT_COLUMNS) | {"finite", "decode_start"} <= set(empty.names)
    assert _optional(empty.names) == set()
    # the order of the columns is the schema's, and its metadata stays
    meta = SCHEMA.with_metadata({"osdn_diag.run_id": "r"})
    got = filled_schema(meta, [decayed])
    assert got.names == [n for n in SCHEMA.names if n in got.names]
    assert got.metadata == {b"osdn_diag.run_id": b"r"}


def test_an_ungated_run_leaves_every_optional_column_out(tmp_path):
    tables = [_rows(layer, 10 * batch + layer) for batch in range(3) for layer in range(4)]
    path = tmp_path / "residuals.parquet"
    _encode(path, tables)
    back = pq.read_table(path)
    assert _optional(back.column_names) == set()
    assert back.column_names == [n for n in SCHEMA.names if n not in optional_columns()]
    # the rows of every call in the order they came (the first pass was held, then written first)
    want = pa.concat_tables(tables).select(back.column_names)
    assert back.equals(want)


def test_a_column_one_layer_of_the_first_pass_fills_is_kept_for_all(tmp_path):
    # layer 1 decays, layer 0 does not: the decay's columns are in the file, null on layer 0's rows
    tables = [_rows(layer, 10 * batch + layer, DECAY if layer == 1 else ()) for batch in range(2) for layer in range(2)]
    path = tmp_path / "residuals.parquet"
    _encode(path, tables)
    back = pq.read_table(path)
    assert _optional(back.column_names) == set(DECAY)
    assert back.equals(pa.concat_tables(tables).select(back.column_names))
    layer = back["layer"].to_numpy()
    for c in DECAY:
        valid = back[c].is_valid().to_numpy(zero_copy_only=False)
        assert not valid[layer == 0].any() and valid[layer == 1].all()


def test_a_family_column_is_kept_with_its_declared_type(tmp_path):
    tables = [_rows(0, 0, ("step", "token_ratio")), _rows(0, 1, ("step", "token_ratio"))]
    path = tmp_path / "residuals.parquet"
    _encode(path, tables)
    back = pq.read_table(path)
    assert _optional(back.column_names) == {"step", "token_ratio"}
    assert back.schema.field("step").type == pa.int32()


def test_a_run_with_no_call_writes_the_columns_of_the_contract(tmp_path):
    path = tmp_path / "residuals.parquet"
    _encode(path, [])
    back = pq.read_table(path)
    assert back.num_rows == 0 and _optional(back.column_names) == set()
    assert set(CONTRACT_COLUMNS) <= set(back.column_names)


def test_a_later_call_that_fills_a_column_left_out_is_refused_and_nothing_takes_the_name(tmp_path):
    tables = [_rows(0, 0), _rows(1, 1), _rows(0, 2), _rows(1, 3, DECAY)]
    with pytest.raises(RuntimeError, match="residuals.parquet failed") as info:
        with _residuals_writer(tmp_path, SCHEMA, Ranks()) as encoder:
            for table in tables:
                encoder.write(table)
    cause = str(info.value.__cause__)
    assert "layer 1" in cause and "loss_before_decayed" in cause
    assert not (tmp_path / "residuals.parquet").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary left either
