"""``benchmarks/bench_replay.py``'s two-pass replay rows (``--states``, ``--states-sweep``): the wiring runs on
the CPU under Triton's interpreter at a tiny shape, with the GPU timers replaced (the timings are the
GPU's to measure)."""

from __future__ import annotations

import itertools
import json

import pytest


@pytest.fixture
def bench_replay(benchmark_script, fla_interpreter, monkeypatch):
    """The script on the CPU: each timed call runs once and reads 10, 9, 8, … ms (the later the
    faster, so a sweep's best is its last point), each kernel timeline one kernel of 1 µs."""
    mod = benchmark_script("bench_replay")
    clock = itertools.count(10, -0.25)

    def bench(fn, name=None, **_):
        fn()
        return next(clock)

    def kernel_timeline(fn, calls=10):
        fn()
        return [("kernel", 1.0)]

    monkeypatch.setattr(mod, "DEVICE", "cpu")
    monkeypatch.setattr(mod, "bench", bench)
    monkeypatch.setattr(mod, "kernel_timeline", kernel_timeline)
    return mod


TINY = ["--B", "1", "--T", "20", "--H", "2", "--skip-torch"]


def test_states_row_and_sweep_beside_the_chunked_and_fused_replays(bench_replay, tmp_path, capsys):
    path = tmp_path / "replay.json"
    out = bench_replay.main([*TINY, "--K", "16", "--V", "24", "--gate", "head", "--chunk", "--states",
                             "--states-sweep", "--states-chunks", "16", "--states-bv", "16,32", "--states-warps", "4",
                             "--states-stages", "1", "--states-out", "16x2,32x4", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    ms = out["ms"]
    assert {"fused replay (ours, fp32)", "chunked replay (ours, fp32)", "two-pass chunked replay (ours, fp32)",
            "fla fused_recurrent_gated_delta_rule (head gate, fp32)"} <= set(ms)
    for name in ("o", "loss_before", "loss_after", "final_state", "loss_before_decayed"):
        assert out["errors_vs_fp64"][f"states {name}"] <= 1e-5, name
    assert out["states_kernels_us"] == [("kernel", 1.0)]
    # V = 24: block_v 16 and 32 (two V-blocks, and one of 32 rows over 24), then both output points at
    # the faster; the last point timed is the best
    points = [r for r in out["sweep"] if r["kernel"] == "states"]
    assert [(r["block_v"], r.get("out_block_v")) for r in points] == [(16, None), (32, None), (32, 16), (32, 32)]
    assert all(r["max_error"] <= 1e-5 and r["chunk_size"] == 16 for r in points)
    (best,) = [n for n in ms if n.startswith("two-pass chunked replay, best")]
    assert "block_v=32" in best and "out_block_v=32, out_num_warps=4" in best
    assert ms[best] == points[-1]["ms"] == min(r["ms"] for r in points)
    printed = capsys.readouterr().out
    assert printed.count("states sweep chunk_size=16") == 4
    assert "two-pass replay, kernel by kernel: kernel 1 us" in printed
    assert "two-pass chunked replay (ours, fp32)" in printed


def test_states_takes_keys_of_256_channels_where_the_chunked_replay_does_not(bench_replay, monkeypatch):
    """K = 256 (past the one-pass replay's 128), with the launch given on the command line."""
    from osdn_diag.ops import replay_chunk_states

    launches = []
    real = replay_chunk_states.chunk_replay_states
    monkeypatch.setattr(replay_chunk_states, "chunk_replay_states", lambda *a, **kw: launches.append(kw) or real(*a, **kw))
    out = bench_replay.main(["--B", "1", "--T", "6", "--H", "1", "--skip-torch", "--K", "256", "--V", "16",
                             "--chunk", "--states", "--states-launch", "chunk_size=16,block_k=128,precision=ieee"])
    assert out["states_launch"] == dict(chunk_size=16, block_k=128, precision="ieee")
    assert "two-pass chunked replay (ours, fp32)" in out["ms"] and "chunked replay (ours, fp32)" not in out["ms"]
    assert max(out["errors_vs_fp64"][f"states {n}"] for n in ("o", "loss_before", "loss_after", "final_state")) <= 1e-5
    assert launches and all(kw["block_k"] == 128 and kw["chunk_size"] == 16 for kw in launches)


def test_states_refuses_a_channel_gate_in_one_line(bench_replay, capsys):
    out = bench_replay.main(["--B", "1", "--T", "4", "--H", "1", "--skip-torch", "--K", "16", "--V", "16",
                             "--gate", "channel", "--states"])
    assert not any("two-pass" in n for n in out["ms"])
    assert "--states: the two-pass replay takes keys of at most 256 channels and no channel gate" in capsys.readouterr().out
