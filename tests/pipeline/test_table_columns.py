"""Which columns ``residuals.parquet`` holds: every column of the contract, and of the columns only some
layers fill (a decay's, a kernel family's own) those that the run's layers fill. The writer is told the
kinds of the run's layers (family, and whether it decays) and holds tables only until one of each kind
has come: none after the first in a model of one kind. The rows are the calls' rows in the order they
came, value for value; a later call that fills a column left out is refused, naming its layer, and
nothing takes the table's name. Without the kinds, every column is written."""

from __future__ import annotations

import functools
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from osdn_diag.distributed import Ranks
from osdn_diag.pipeline.writers import _ParquetEncoder, _residuals_writer
from osdn_diag.replay.replayer import _arrow_table, _schema, filled_schema, optional_columns, table_kind
from osdn_diag.replay.runs import CONTRACT_COLUMNS

SCHEMA = _schema(pa.float32())
DECAY = ("loss_before_decayed", "residual_ratio_post")
PROMPTS = {0: {"task": "lm-heldout", "repeat_start": -1}, 1: {"task": "mqar", "repeat_start": 4}}
PLAIN, GATED = ("delta_rule", False), ("gated_delta_rule", True)


def _host(seed: int, extra: tuple[str, ...] = (), T: int = 6, H: int = 2) -> dict:
    """One call's host columns (2 sequences of T tokens, H heads) as the replay hands them over;
    ``extra``: further columns the call's replay filled."""
    rng = np.random.default_rng(seed)
    n = 2 * H * T
    cols = {"sequence": np.repeat(np.arange(2, dtype=np.int32), H * T),
            "head": np.tile(np.repeat(np.arange(H, dtype=np.int32), T), 2),
            "pos": np.tile(np.arange(T, dtype=np.int32), 2 * H), "finite": np.ones(n, dtype=bool)}
    for name in ("beta", "key_sqnorm", "write_gain", "loss_before", "loss_after", "residual_ratio", *extra):
        cols[name] = rng.random(n, dtype=np.float32)
    if "step" in extra:
        cols["step"] = np.zeros(n, dtype=np.float32)
    return {k: torch.from_numpy(v) for k, v in cols.items()}


def _call(layer: int, seed: int, kind=PLAIN, extra: tuple[str, ...] = ()):
    """A builder of one call's rows, with its kind, as ``Replayer.add(..., table=False)`` returns it."""
    rows = functools.partial(_arrow_table, [0, 1], layer, _host(seed, extra), [6, 6], PROMPTS, SCHEMA, "float32")
    rows.kind = kind
    return rows


def _rows(layer: int, seed: int, extra: tuple[str, ...] = ()) -> pa.Table:
    return _call(layer, seed, extra=extra)()


def _encode(path, calls, kinds) -> _ParquetEncoder:
    encoder = _ParquetEncoder(str(path), SCHEMA, path)
    if kinds is not None:
        encoder.expect(kinds)
    for call in calls:
        encoder.write(call)
    encoder.close()
    return encoder


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


def test_table_kind_of_a_call_and_of_a_manifest_entry():
    class Call:
        family, gated = "gated_delta_rule", True

    assert table_kind(Call()) == GATED
    assert table_kind({"family": "delta_rule", "gated": False, "layer": 3}) == PLAIN


def test_an_ungated_run_leaves_every_optional_column_out(tmp_path):
    calls = [_call(layer, 10 * batch + layer) for batch in range(3) for layer in range(4)]
    path = tmp_path / "residuals.parquet"
    _encode(path, calls, {PLAIN})
    back = pq.read_table(path)
    assert _optional(back.column_names) == set()
    assert back.column_names == [n for n in SCHEMA.names if n not in optional_columns()]
    # the rows of every call in the order they came, value for value
    assert back.equals(pa.concat_tables([c() for c in calls]).select(back.column_names))


def test_one_kind_opens_the_file_on_the_first_table(tmp_path):
    """Nothing is held back in a model of one kind: the first table decides, and is written at once."""
    path = tmp_path / "residuals.parquet"
    encoder = _ParquetEncoder(str(path), SCHEMA, path)
    encoder.expect({PLAIN})
    encoder.write(_call(0, 0))
    deadline = time.monotonic() + 10
    while encoder.writer is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert encoder.writer is not None  # opened, with the first table written, before any second one came
    encoder.close()
    assert pq.read_table(path).num_rows == 24


def test_a_layer_of_each_kind_decides_even_when_a_layer_calls_twice(tmp_path):
    # layer 0 runs its kernel twice a batch and does not decay; layer 1 decays: the decay's columns are
    # in the file, null on layer 0's rows
    calls = [c for batch in range(2) for c in (_call(0, 10 * batch), _call(0, 10 * batch + 1),
                                               _call(1, 10 * batch + 2, GATED, DECAY))]
    path = tmp_path / "residuals.parquet"
    _encode(path, calls, {PLAIN, GATED})
    back = pq.read_table(path)
    assert _optional(back.column_names) == set(DECAY)
    assert back.equals(pa.concat_tables([c() for c in calls]).select(back.column_names))
    layer = back["layer"].to_numpy()
    for c in DECAY:
        valid = back[c].is_valid().to_numpy(zero_copy_only=False)
        assert not valid[layer == 0].any() and valid[layer == 1].all()


def test_a_family_column_is_kept_with_its_declared_type(tmp_path):
    kind = ("gated_delta_product", False)
    calls = [_call(0, 0, kind, ("step", "token_ratio")), _call(0, 1, kind, ("step", "token_ratio"))]
    path = tmp_path / "residuals.parquet"
    _encode(path, calls, {kind})
    back = pq.read_table(path)
    assert _optional(back.column_names) == {"step", "token_ratio"}
    assert back.schema.field("step").type == pa.int32()


def test_without_the_kinds_every_column_is_written(tmp_path):
    path = tmp_path / "residuals.parquet"
    calls = [_call(0, 0), _call(1, 1)]
    _encode(path, calls, None)
    back = pq.read_table(path)
    assert back.schema.names == SCHEMA.names
    assert back.equals(pa.concat_tables([c() for c in calls]))


@pytest.mark.parametrize("kinds", [set(), {PLAIN}, {PLAIN, GATED}])
def test_a_run_with_no_call_writes_the_columns_of_the_contract(tmp_path, kinds):
    path = tmp_path / "residuals.parquet"
    _encode(path, [], kinds)
    back = pq.read_table(path)
    assert back.num_rows == 0 and _optional(back.column_names) == set()
    assert set(CONTRACT_COLUMNS) <= set(back.column_names)


def test_a_later_call_that_fills_a_column_left_out_is_refused_and_nothing_takes_the_name(tmp_path):
    # announced as one ungated kind, but a later call's rows carry the decay's columns
    calls = [_call(0, 0), _call(1, 1), _call(0, 2), _call(1, 3, PLAIN, DECAY)]
    with pytest.raises(RuntimeError, match="residuals.parquet failed") as info:
        with _residuals_writer(tmp_path, SCHEMA, Ranks()) as encoder:
            encoder.expect({PLAIN})
            for call in calls:
                encoder.write(call)
    cause = str(info.value.__cause__)
    assert "layer 1" in cause and "loss_before_decayed" in cause
    assert not (tmp_path / "residuals.parquet").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary left either


@pytest.fixture(scope="module")
def hybrid(fla_interpreter):
    """A random DeltaNet-tiny whose second block is a Gated DeltaNet layer (it decays; the first does
    not), with the first block run twice a forward pass (shared weights): three kernel calls a batch,
    two of them of layer 0."""
    from fla.layers import GatedDeltaNet

    from osdn_diag.models import load_model

    loaded = load_model("random:deltanet-tiny")
    torch.manual_seed(0)
    blocks = loaded.model.model.layers
    blocks[1].attn = GatedDeltaNet(hidden_size=64, num_heads=2, head_dim=32, expand_v=1.0, layer_idx=1,
                                   mode="chunk")
    blocks.insert(1, blocks[0])
    return loaded


@pytest.mark.parametrize("stream", [False, True], ids=["stored", "stream"])
def test_a_hybrid_model_whose_layer_calls_twice_keeps_the_decay_columns(hybrid, tmp_path, stream):
    from osdn_diag.pipeline import capture_run, replay_run, stream_run

    out = tmp_path / "run"
    if stream:
        stream_run(hybrid, "random", out, num_prompts=3, length=12, batch_size=2, progress=False)
    else:
        capture_run(hybrid, "random", out, num_prompts=3, length=12, batch_size=2, progress=False)
        assert (out / "capture" / "batch_00000" / "layer_000_call1.safetensors").is_file()
        replay_run(out, progress=False)
    back = pq.read_table(out / "residuals.parquet")
    assert _optional(back.column_names) == set(DECAY)
    layer = back["layer"].to_numpy()
    assert back.num_rows == 3 * 12 * 2 * 3  # prompts × tokens × heads × calls a forward pass
    for c in DECAY:
        valid = back[c].is_valid().to_numpy(zero_copy_only=False)
        assert not valid[layer == 0].any() and valid[layer == 1].all()
