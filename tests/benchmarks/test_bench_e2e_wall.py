"""``benchmarks/bench_e2e.py --wall``: the command as typed, timed as fresh processes, with the host's
yardstick beside the times (the command itself is stubbed here: what is tested is the timing's
bookkeeping, not the run)."""

from __future__ import annotations

import json
import subprocess


def test_wall_prints_and_records_the_host_yardstick(benchmark_script, tmp_path, monkeypatch, capsys):
    bench = benchmark_script("bench_e2e")
    commands = []

    def fake_run(cmd, env, stdout, stderr):  # the command writes its summary into --out, as a run does
        commands.append((cmd, env["TRITON_CACHE_DIR"]))
        out = cmd[cmd.index("--out") + 1]
        (tmp_path / out).mkdir(parents=True, exist_ok=True)
        (tmp_path / out / "summary.json").write_text(json.dumps({"n": 12, "q_geo": 0.25}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    report = tmp_path / "wall.json"
    result = bench.main(["--wall", "2", "--dir", str(tmp_path / "runs"), "--json", str(report)])
    out = capsys.readouterr().out
    assert len(commands) == 2 and commands[0][1] == commands[1][1]  # one Triton cache: the second run warm
    assert "--stream" in commands[0][0] and commands[0][0][1:4] == ["-m", "osdn_diag", "run"]
    loop = result["python_loop_s"]
    assert 0 < loop < 10 and f"the Python yardstick loop took {loop * 1e3:.0f} ms" in out
    assert "cpu_model" in result  # the CPU's name where Linux gives it, else None
    saved = json.loads(report.read_text())
    assert saved["python_loop_s"] == loop and saved["warm_s"] == result["warm_s"] and len(saved["warm_s"]) == 1
