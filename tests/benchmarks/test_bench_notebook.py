"""benchmarks/bench_notebook.py runs on the CPU and reports what it measured."""

from __future__ import annotations


def test_three_diagnostics_in_one_process(benchmark_script, fla_interpreter, capsys):
    out = benchmark_script("bench_notebook").main(
        ["--model", "random:deltanet-tiny", "--prompts", "2", "--T", "16", "--batch", "2"])
    assert set(out["seconds"]) == {"imports", "load", "first", "second", "third"}
    assert out["measurements"] > 0 and 0 < out["q_geo"] < 1
    assert "second diagnostic / first" in capsys.readouterr().out
