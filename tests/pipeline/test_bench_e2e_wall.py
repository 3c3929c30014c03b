"""``benchmarks/bench_e2e.py --wall N``: the command as a user types it, timed as a fresh process, the
first run with an empty Triton cache of its own and the others sharing it, each into a fresh --out.

On a CPU, ``--device cpu``: the reference recurrence stands in for fla's kernels (nothing compiles),
so the first run is not slower here; what is tested is the benchmark's own work."""

from __future__ import annotations

import json
import sys


def test_wall_times_the_cli_as_typed_on_the_cpu(tmp_path, capsys, benchmark_script):
    bench = benchmark_script("bench_e2e")
    result = bench.main(["--wall", "1", "--model", "random:deltanet-tiny", "--prompts", "1", "--T", "16",
                         "--batch-size", "1", "--device", "cpu", "--dir", str(tmp_path),
                         "--json", str(tmp_path / "wall.json")])
    assert json.loads((tmp_path / "wall.json").read_text()) == result
    assert result["command"][:4] == [sys.executable, "-m", "osdn_diag", "run"]
    assert result["command"][-4:] == ["--device", "cpu", "--out", "DIR"] and "--stream" in result["command"]
    assert result["first_s"] > 0 and result["warm_s"] == [] and result["warm_median_s"] is None
    # The run finished: 1 prompt x 16 tokens x 2 layers x 2 heads measured.
    assert result["n"] == 64 and json.loads((tmp_path / "wall-0" / "summary.json").read_text())["n"] == 64
    out = capsys.readouterr().out
    assert "run 1/1 (first, empty Triton cache)" in out and "first run" in out


# A stand-in for the CLI: records what it saw (its --out, the Triton cache directory and what was in
# it), leaves a "compiled kernel" in the cache and writes the summary a run writes.
FAKE_RUN = """
import json, os, sys
out, cache = sys.argv[-1], os.environ["TRITON_CACHE_DIR"]
seen = sorted(os.listdir(cache)) if os.path.isdir(cache) else None
os.makedirs(os.path.join(cache, "key"), exist_ok=True)
open(os.path.join(cache, "key", "kernel.cubin"), "w").close()
os.makedirs(out)
json.dump({"n": 3, "q_geo": 0.5, "out": out, "cache": cache, "seen": seen,
           "fresh_out": os.listdir(out) == []}, open(os.path.join(out, "summary.json"), "w"))
"""


def test_the_first_run_gets_an_empty_private_cache_the_others_share_it(tmp_path, monkeypatch, capsys,
                                                                        benchmark_script):
    bench = benchmark_script("bench_e2e")
    monkeypatch.setattr(bench, "wall_command", lambda a, out: [sys.executable, "-c", FAKE_RUN, out])
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "the-users-cache"))
    args = ["--wall", "3", "--model", "random:deltanet-tiny", "--prompts", "2", "--dir", str(tmp_path / "d")]
    for attempt in range(2):  # --dir reused: its cache is emptied again, the runs' --out are fresh
        result = bench.main(args)
        seen = [json.loads((tmp_path / "d" / f"wall-{i}" / "summary.json").read_text()) for i in range(3)]
        assert len({s["cache"] for s in seen}) == 1 and "the-users-cache" not in seen[0]["cache"]
        assert seen[0]["seen"] is None and seen[1]["seen"] == seen[2]["seen"] == ["key"]
        assert len({s["out"] for s in seen}) == 3
        assert len(result["warm_s"]) == 2 and result["warm_median_s"] == sum(result["warm_s"]) / 2
        assert result["runs"] == 3 and result["first_s"] > 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("run ")]
    assert [line.split(":")[0] for line in lines[:3]] == [
        "run 1/3 (first, empty Triton cache)", "run 2/3 (warm)", "run 3/3 (warm)"]


def test_a_failed_run_stops_the_benchmark_with_its_output(tmp_path, monkeypatch, benchmark_script):
    import pytest

    bench = benchmark_script("bench_e2e")
    monkeypatch.setattr(bench, "wall_command",
                        lambda a, out: [sys.executable, "-c", "import sys; print('no such model'); sys.exit(2)"])
    with pytest.raises(SystemExit, match=r"run 1 exited with status 2(.|\n)*no such model"):
        bench.main(["--wall", "2", "--dir", str(tmp_path)])


def test_the_host_yardstick_is_printed_and_recorded(tmp_path, monkeypatch, capsys, benchmark_script):
    """A fixed pure-Python loop timed beside the runs, and the CPU's name where Linux gives it."""
    bench = benchmark_script("bench_e2e")
    monkeypatch.setattr(bench, "wall_command", lambda a, out: [sys.executable, "-c", FAKE_RUN, out])
    result = bench.main(["--wall", "1", "--dir", str(tmp_path / "d"), "--json", str(tmp_path / "w.json")])
    loop = result["python_loop_s"]
    assert 0 < loop < 10 and "cpu_model" in result
    assert f"the Python yardstick loop took {loop * 1e3:.0f} ms" in capsys.readouterr().out
    assert json.loads((tmp_path / "w.json").read_text())["python_loop_s"] == loop
