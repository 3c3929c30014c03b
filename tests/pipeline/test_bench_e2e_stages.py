"""``benchmarks/bench_e2e.py --stages``: the stage timers see every call and leave the pipeline as it was.

Kernels: the default ``kernels="auto"``, so on a CPU the reference recurrence stands in for fla's kernel;
test_fla_kernels_e2e.py runs fla's own kernels end to end.
"""

from __future__ import annotations


def test_stages_time_every_call_and_restore_the_pipeline(tmp_path, capsys, benchmark_script):
    from osdn_diag.pipeline import writers
    from osdn_diag.replay import replayer

    original_add, original_write = replayer.Replayer.add, writers._ParquetEncoder.write
    bench = benchmark_script("bench_e2e")
    result = bench.main(["--model", "random:deltanet-tiny", "--prompts", "4", "--T", "32", "--batch-size", "2",
                         "--mode", "stream", "--stages", "--dir", str(tmp_path)])
    stages = {(s["stage"].strip(), s["thread"]): s for s in result["stages"]["stages"]}
    # 2 forward batches x 2 layers = 4 captured calls, each replayed once and handed to the writer once
    assert stages[("replay one call (everything below)", "MainThread")]["calls"] == 4
    assert stages[("waiting to hand rows to the writer", "MainThread")]["calls"] == 4
    assert stages[("parquet encoding", "residuals-writer")]["calls"] == 4
    whole = stages[("forwards, each call replayed as captured", "MainThread")]["seconds"]
    assert 0 < stages[("replay one call (everything below)", "MainThread")]["seconds"] <= whole
    assert "stage by stage" in capsys.readouterr().out
    assert replayer.Replayer.add is original_add and writers._ParquetEncoder.write is original_write


def test_the_every_column_baseline_writes_every_column_and_restores_the_writer(tmp_path, capsys, benchmark_script):
    import pyarrow.parquet as pq

    from osdn_diag.pipeline import writers
    from osdn_diag.replay.replayer import optional_columns

    original = writers._ParquetEncoder.expect
    bench = benchmark_script("bench_e2e")
    result = bench.main(["--model", "random:deltanet-tiny", "--prompts", "4", "--T", "32", "--batch-size", "2",
                         "--mode", "stream,stream-every-column", "--dir", str(tmp_path)])
    assert [r["mode"] for r in result["rows"]] == ["stream", "stream-every-column"]
    assert not set(optional_columns()) & set(pq.read_table(tmp_path / "stream" / "residuals.parquet").column_names)
    every = pq.read_table(tmp_path / "stream-every-column" / "residuals.parquet")
    assert set(optional_columns()) <= set(every.column_names)
    assert "against stream-every-column" in capsys.readouterr().out
    assert writers._ParquetEncoder.expect is original
