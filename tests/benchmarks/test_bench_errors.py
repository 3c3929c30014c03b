"""benchmarks/bench_errors.py times every refused command as typed and checks how each is refused."""

from __future__ import annotations

import statistics


def test_every_case_is_refused_in_one_line_and_timed(benchmark_script, capsys):
    out = benchmark_script("bench_errors").main(["--repeat", "2"])
    rows = out["rows"]
    assert rows[0]["case"] == "python -c pass"
    assert {r["group"] for r in rows} == {"baseline", "help", "argument", "model"}
    printed = capsys.readouterr().out
    for r in rows:
        assert len(r["times_s"]) == 2 and r["median_s"] == statistics.median(r["times_s"])
        assert abs(r["vs_baseline"] - r["median_s"] / rows[0]["median_s"]) < 1e-12
        assert f"{r['median_s']:7.3f}s {r['vs_baseline']:17.1f}×" in printed
    for group in ("argument", "model"):
        assert out["slowest"][group] == max(r["median_s"] for r in rows if r["group"] == group)


def test_a_case_not_refused_as_promised_stops_the_benchmark(benchmark_script, monkeypatch):
    """A case that exits otherwise than expected (here: a model directory that loads) is an error of
    the benchmark, not a time."""
    import pytest

    bench = benchmark_script("bench_errors")
    real = bench.cases
    monkeypatch.setattr(bench, "cases", lambda root: [("argument", "help exits 0", ["--help"], 2)] + real(root)[:0])
    with pytest.raises(SystemExit, match="help exits 0: exit 0 \\(expected 2\\)"):
        bench.main(["--repeat", "1"])


def test_a_repeat_below_one_is_refused_by_argparse(benchmark_script, monkeypatch, capsys):
    """--repeat 0 timed nothing and ended in UnboundLocalError (the loop's last run read after it);
    now argparse refuses a repeat below 1 (exit status 2, its usage line), before any command runs."""
    import pytest

    bench = benchmark_script("bench_errors")
    monkeypatch.setattr(bench, "_time", lambda argv: pytest.fail(f"ran {argv}"))
    for value in ("0", "-1"):
        with pytest.raises(SystemExit) as refused:
            bench.main(["--repeat", value])
        assert refused.value.code == 2
        assert f"argument --repeat: expected a whole number of at least 1, not {value!r}" in capsys.readouterr().err
