"""``benchmarks/bench_e2e.py --stages``: the stage timers see every call and leave the pipeline as it was."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _bench_e2e():
    sys.path.insert(0, str(BENCH))  # the script imports its sibling ``_common``
    try:
        spec = importlib.util.spec_from_file_location("bench_e2e", BENCH / "bench_e2e.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_stages_time_every_call_and_restore_the_pipeline(tmp_path, capsys):
    from osdn_diag import pipeline, replayer

    original_add, original_write = replayer.Replayer.add, pipeline._ParquetEncoder.write
    bench = _bench_e2e()
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
    assert replayer.Replayer.add is original_add and pipeline._ParquetEncoder.write is original_write
