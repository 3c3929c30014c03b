"""Replay throughput: the fused Triton replay against the torch reference loop and fla's fp32
``fused_recurrent_delta_rule`` on the same inputs (GPU only).

    python benchmarks/bench_replay.py [--B 8 --T 4096 --H 8 --K 128 --V 128] [--chunk] [--states] [--json FILE]
    python benchmarks/bench_replay.py --captured RUN_DIR     (errors on a capture's own inputs)

Prints a table (median time, measurements per second, ratios against both baselines measured in the
same run) after checking the fused replay (and, with ``--chunk``, the chunked replay) against an fp64
reference at the benchmark shape. ``--states`` adds the two-pass chunked replay
(``osdn_diag.ops.replay_chunk_states``, keys up to 256; its errors as ``states …``), ``--states-sweep`` its
launch configurations. ``--captured`` replays every call a capture stored (``osdn-diag
capture``; its keys are a model's, correlated as a model makes them) with both replays and prints
their largest relative errors against the fp64 reference, field by field.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import time

import torch
from _common import bench, kernel_timeline, rel, write_json

#: Where the inputs live and the replays run. The tests set ``"cpu"`` (Triton's interpreter) with the
#: timers replaced: the script's wiring runs there, its timings only on a GPU.
DEVICE = "cuda"


def _device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE


def _launch(text: str) -> dict:
    """``NAME=VALUE,...`` as keyword arguments: ints where they parse, else strings (``precision``)."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {item!r}")
        out[name.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return out


def _timed_once(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("B", 8), ("T", 4096), ("H", 8), ("K", 128), ("V", 128)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--skip-torch", action="store_true", help="skip the slow torch reference loop")
    p.add_argument("--gate", choices=("none", "head", "channel"), default="none",
                   help="a decay gate (log decay in [-0.1, 0)): per head, against fla's "
                        "fused_recurrent_gated_delta_rule(g=...), or per key channel (gk=...)")
    p.add_argument("--sweep", action="store_true",
                   help="also time launch configurations (block_v x key_lanes x key_groups x stages, contiguous "
                        "keys or not; then num_warps and prefetch) of the fused replay")
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    p.add_argument("--sweep-rows", type=ints, default=(8, 16), metavar="N,N,...",
                   help="--sweep's state rows per program (8,16)")
    p.add_argument("--sweep-lanes", type=ints, default=(2, 4, 8), metavar="N,N,...",
                   help="--sweep's key lanes (2,4,8)")
    p.add_argument("--sweep-groups", type=ints, default=(1, 4), metavar="N,N,...",
                   help="--sweep's key groups, the partial sums of each product (1,4)")
    p.add_argument("--sweep-stages", type=ints, default=(0, 3), metavar="N,N,...",
                   help="--sweep's pipeline stages of the loads (0: the register prefetch) (0,3)")
    p.add_argument("--chunk", action="store_true",
                   help="also time the chunked replay (osdn_diag.ops.replay_chunk; no channel gate)")
    p.add_argument("--chunk-sweep", action="store_true",
                   help="with --chunk: also time its launch configurations (chunk sizes x state rows x warps x "
                        "pipeline stages, and one point of plain fp32 products)")
    p.add_argument("--states", action="store_true",
                   help="also time the two-pass chunked replay (osdn_diag.ops.replay_chunk_states; K <= 256, "
                        "no channel gate)")
    p.add_argument("--states-launch", type=_launch, default={}, metavar="NAME=VALUE,...",
                   help="--states' launch options instead of the op's defaults, e.g. "
                        "chunk_size=64,block_v=16,num_warps=8,num_stages=1,out_block_v=64")
    p.add_argument("--states-sweep", action="store_true",
                   help="also time the two-pass replay's launch configurations: chunk size x state rows (block_v) "
                        "x warps x pipeline stages of its state walk, then the output pass's rows and warps at "
                        "the best of those")
    p.add_argument("--states-chunks", type=ints, default=(32, 64), metavar="N,N,...",
                   help="--states-sweep's chunk sizes (32,64)")
    p.add_argument("--states-bv", type=ints, default=(16, 32), metavar="N,N,...",
                   help="--states-sweep's state rows per program of the state walk (16,32)")
    p.add_argument("--states-warps", type=ints, default=(4, 8), metavar="N,N,...",
                   help="--states-sweep's warps of the state walk (4,8)")
    p.add_argument("--states-stages", type=ints, default=(1, 2), metavar="N,N,...",
                   help="--states-sweep's pipeline stages of the state walk (1,2)")
    p.add_argument("--states-bk", type=ints, default=(64,), metavar="N,N,...",
                   help="--states-sweep's key rows per state tile (64; at most 4 tiles)")
    p.add_argument("--states-out", default="16x4,32x4,64x4,64x8", metavar="BVxW,...",
                   help="--states-sweep's output-pass points, state rows x warps (16x4,32x4,64x4,64x8)")
    p.add_argument("--captured", metavar="RUN_DIR",
                   help="instead of timing: the errors of both replays against fp64 on every call a capture stored")
    a = p.parse_args(argv)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_replay needs a CUDA GPU")
    if a.captured:
        return captured_errors(a.captured, a.json)

    from osdn_diag.math import delta_rule_recurrence
    from osdn_diag.ops.replay import STATE_ENTRIES, fused_replay

    dev = DEVICE
    gen = torch.Generator(device=dev).manual_seed(0)
    B, T, H, K, V = a.B, a.T, a.H, a.K, a.V
    q = torch.randn(B, T, H, K, device=dev, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, device=dev, generator=gen)
    beta = torch.rand(B, T, H, device=dev, generator=gen)
    n_meas = B * T * H
    g = None
    if a.gate != "none":
        shape = (B, T, H) if a.gate == "head" else (B, T, H, K)
        g = -0.1 * torch.rand(shape, device=dev, generator=gen)

    # Correctness at the benchmark shape, against fp64 on the same device.
    ref = delta_rule_recurrence(q, k, v, beta, g=g, dtype=torch.float64)
    got = fused_replay(q, k, v, beta, g=g)
    errors = {n: rel(getattr(got, n), getattr(ref, n)) for n in ("o", "loss_before", "loss_after", "final_state")}

    from osdn_diag.ops.replay_chunk import MAX_KEY_DIM

    chunk = a.chunk and a.gate != "channel" and K <= MAX_KEY_DIM
    if chunk:
        from osdn_diag.ops.replay_chunk import chunk_replay

        got = chunk_replay(q, k, v, beta, g=g)
        errors.update({f"chunk {n}": rel(getattr(got, n), getattr(ref, n))
                       for n in ("o", "loss_before", "loss_after", "final_state")})

    from osdn_diag.ops.replay_chunk_states import MAX_KEY_DIM as STATES_MAX_KEY_DIM

    states = (a.states or a.states_sweep) and a.gate != "channel" and K <= STATES_MAX_KEY_DIM
    if (a.states or a.states_sweep) and not states:
        print(f"--states: the two-pass replay takes keys of at most {STATES_MAX_KEY_DIM} channels and no "
              f"channel gate (K = {K}, gate {a.gate}): not run", flush=True)
    if states:
        from osdn_diag.ops.replay_chunk_states import chunk_replay_states

        # the benchmark's shape may store more than the op's default bound (a GPU has room for it)
        states_kw = dict(max_state_bytes=1 << 40, **a.states_launch)
        got = chunk_replay_states(q, k, v, beta, g=g, **states_kw)
        errors.update({f"states {n}": rel(getattr(got, n), getattr(ref, n))
                       for n in ("o", "loss_before", "loss_after", "final_state")})
        if g is not None:
            errors["states loss_before_decayed"] = rel(got.loss_before_decayed, ref.loss_before_decayed)
        del got

    rows = []
    t_fused = bench(lambda: fused_replay(q, k, v, beta, g=g), rep=100)
    rows.append(("fused replay (ours, fp32)", t_fused))
    t_fla = None
    try:
        if g is None:
            from fla.ops.delta_rule import fused_recurrent_delta_rule

            t_fla = bench(lambda: fused_recurrent_delta_rule(q, k, v, beta, output_final_state=True), rep=100)
            rows.append(("fla fused_recurrent_delta_rule (fp32)", t_fla))
        else:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

            gate = dict(g=g) if a.gate == "head" else dict(gk=g)
            t_fla = bench(lambda: fused_recurrent_gated_delta_rule(q, k, v, beta=beta, **gate,
                                                                   output_final_state=True), rep=100)
            rows.append((f"fla fused_recurrent_gated_delta_rule ({a.gate} gate, fp32)", t_fla))
    except ImportError:
        pass
    timeline = None
    if chunk:
        rows.append(("chunked replay (ours, fp32)", bench(lambda: chunk_replay(q, k, v, beta, g=g), rep=100)))
        timeline = kernel_timeline(lambda: chunk_replay(q, k, v, beta, g=g))
        print("chunked replay, kernel by kernel: " + ", ".join(f"{n[:40]} {us:.0f} us" for n, us in timeline), flush=True)
    states_timeline = None
    if states:
        rows.append(("two-pass chunked replay (ours, fp32)",
                     bench(lambda: chunk_replay_states(q, k, v, beta, g=g, **states_kw), rep=100)))
        states_timeline = kernel_timeline(lambda: chunk_replay_states(q, k, v, beta, g=g, **states_kw))
        print("two-pass replay, kernel by kernel: " + ", ".join(f"{n[:40]} {us:.0f} us" for n, us in states_timeline),
              flush=True)
    t_torch = None
    if not a.skip_torch:
        delta_rule_recurrence(q[:, :8], k[:, :8], v[:, :8], beta[:, :8],
                              g=None if g is None else g[:, :8])  # warm-up
        t_torch = _timed_once(lambda: delta_rule_recurrence(q, k, v, beta, g=g))
        rows.append(("torch reference loop (fp32)", t_torch))

    sweep = []
    if a.chunk_sweep and chunk:
        # chunk sizes x state rows x warps x pipeline stages of the walk; plain fp32 products
        # ("ieee") are FMA loops Triton unrolls: minutes to compile, one point
        points = [*itertools.product((16, 32), (32, 64), (4, 8), (1, 2), ("tf32x3",)), (64, 64, 4, 1, "tf32x3"),
                  (16, 64, 8, 2, "ieee")]
        for C, bv, warps, stages, prec in points:
            if bv > max(V, 16):
                continue
            launch = dict(chunk_size=C, block_v=bv, num_warps=warps, num_stages=stages, precision=prec)
            try:
                ms = bench(lambda: chunk_replay(q, k, v, beta, g=g, **launch), rep=50)
            except Exception as err:  # a configuration that does not compile (shared memory) is skipped
                print(f"chunk sweep {launch}: {type(err).__name__}: {str(err)[:120]}", flush=True)
                continue
            out = chunk_replay(q, k, v, beta, g=g, **launch)
            err = max(rel(getattr(out, n), getattr(ref, n)) for n in ("o", "loss_before", "loss_after", "final_state"))
            sweep.append(dict(launch, kernel="chunk", ms=ms, max_error=err))
            print("chunk sweep " + " ".join(f"{n}={x!s:6}" for n, x in launch.items()) + f": {ms:8.3f} ms"
                  + (f"  ({t_fla / ms:.2f}x fla)" if t_fla else "") + f", largest error vs fp64 {err:.1e}", flush=True)
        best = min(sweep, key=lambda r: r["ms"])
        rows.append(("chunked replay, best (" + ", ".join(f"{n}={best[n]}" for n in
                                                           ("chunk_size", "block_v", "num_warps", "num_stages", "precision")) + ")",
                     best["ms"]))
    if a.states_sweep and states:
        rows += _states_sweep(a, q, k, v, beta, g, ref, t_fla, sweep)
    if a.sweep:
        def timed(**launch):
            ms = bench(lambda: fused_replay(q, k, v, beta, g=g, **launch), rep=100)
            sweep.append(dict(launch, ms=ms))
            print("sweep " + " ".join(f"{n}={x!s:5}" for n, x in launch.items()) + f": {ms:8.3f} ms"
                  + (f"  ({t_fla / ms:.2f}x fla)" if t_fla else ""), flush=True)

        # State rows per program x key lanes x key groups (the state tile's layout) x pipeline
        # stages (0: the register prefetch), with keys interleaved over the lanes or contiguous per
        # lane, one warp (two warps and no prefetch never won: benchmarks/RESULTS.md); then the best
        # of those with two warps and without prefetch. A program holds at most STATE_ENTRIES state
        # entries; key groups beyond a thread's keys (K / key lanes) would repeat a point.
        points = itertools.product(a.sweep_rows, a.sweep_lanes, a.sweep_groups, a.sweep_stages, (False, True))
        for bv, kl, kg, st, contiguous in points:
            if bv <= max(V, 4) and kl <= min(K, 32) and bv * K <= STATE_ENTRIES and kg <= max(K // kl, 1):
                timed(block_v=bv, num_warps=1, key_lanes=kl, key_groups=kg, stages=st, contiguous_keys=contiguous)
        if not any("kernel" not in r for r in sweep):
            raise SystemExit(f"--sweep: no launch configuration fits (rows x K <= {STATE_ENTRIES}, key lanes <= K and 32); "
                             "give other --sweep-rows / --sweep-lanes")
        best = min((r for r in sweep if "kernel" not in r), key=lambda r: r["ms"])
        best_launch = {n: best[n] for n in ("block_v", "key_lanes", "key_groups", "stages", "contiguous_keys")}
        timed(**best_launch, num_warps=2)
        if best_launch["stages"] == 0:
            timed(**best_launch, num_warps=1, prefetch=False)
        best = min((r for r in sweep if "kernel" not in r), key=lambda r: r["ms"])
        rows.append((f"fused replay, best (BV={best['block_v']}, warps={best['num_warps']}, "
                     f"key lanes={best['key_lanes']}, key groups={best['key_groups']}, stages={best['stages']}, "
                     f"contiguous keys={best['contiguous_keys']}"
                     + (f", prefetch={best['prefetch']})" if "prefetch" in best else ")"),
                     best["ms"]))

    print(f"\nreplay, B={B} T={T} H={H} K={K} V={V} ({n_meas / 1e6:.3f} M token-head measurements), "
          f"{_device_name()}")
    print("fused vs fp64 reference, relative error: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    print(f"{'method':40s} {'ms':>10s} {'M meas/s':>10s} {'vs torch':>9s} {'vs fla':>8s}")
    for name, ms in rows:
        vs_t = f"{t_torch / ms:8.1f}x" if t_torch else "      -"
        vs_f = f"{t_fla / ms:7.2f}x" if t_fla else "     -"
        print(f"{name:40s} {ms:10.3f} {n_meas / ms / 1e3:10.1f} {vs_t:>9s} {vs_f:>8s}")
    result = {
        "shape": dict(B=B, T=T, H=H, K=K, V=V), "gate": a.gate,
        "device": _device_name(),
        "torch": torch.__version__,
        "host": platform.node(),
        "errors_vs_fp64": errors,
        "ms": {name: ms for name, ms in rows},
        "sweep": sweep,
        "chunk_kernels_us": timeline,
        "states_kernels_us": states_timeline,
        "states_launch": a.states_launch,
    }
    write_json(a.json, result)
    return result


def _states_sweep(a, q, k, v, beta, g, ref, t_fla, sweep: list) -> list:
    """``--states-sweep``: the two-pass replay at every (chunk size, block_v, block_k, warps, stages) of its
    state walk given on the command line, then the output pass's (rows, warps) points of ``--states-out``
    at the best of those, each launch timed and checked against fp64 (``sweep`` gets a row each, marked
    ``kernel="states"``). Returns the table's rows for the best launch, with its kernels' times."""
    from osdn_diag.ops.replay_chunk_states import chunk_replay_states

    fields = ("o", "loss_before", "loss_after", "final_state")
    rows_cap = max(1 << (v.shape[-1] - 1).bit_length(), 16)  # the op's rows per program at most
    mine = []

    def timed(launch):
        try:
            ms = bench(lambda: chunk_replay_states(q, k, v, beta, g=g, max_state_bytes=1 << 40, **launch), rep=50)
            out = chunk_replay_states(q, k, v, beta, g=g, max_state_bytes=1 << 40, **launch)
        except Exception as err:  # a configuration that does not compile (shared memory, registers) is skipped
            print(f"states sweep {launch}: {type(err).__name__}: {str(err)[:160]}", flush=True)
            return
        err = max(rel(getattr(out, n), getattr(ref, n)) for n in fields)
        del out
        row = dict(launch, kernel="states", ms=ms, max_error=err)
        sweep.append(row)
        mine.append(row)
        print("states sweep " + " ".join(f"{n}={x!s:4}" for n, x in launch.items()) + f": {ms:8.3f} ms"
              + (f"  ({t_fla / ms:.2f}x fla)" if t_fla else "") + f", largest error vs fp64 {err:.1e}", flush=True)

    for C, bv, bk, warps, stages in itertools.product(a.states_chunks, a.states_bv, a.states_bk, a.states_warps,
                                                      a.states_stages):
        if bv > rows_cap or -(-k.shape[-1] // bk) > 4:  # more rows than the padded V repeat a point
            continue
        timed(dict(chunk_size=C, block_v=bv, block_k=bk, num_warps=warps, num_stages=stages))
    if not mine:
        raise SystemExit("--states-sweep: no launch configuration ran (see the lines above)")
    best = min(mine, key=lambda r: r["ms"])
    walk = {n: best[n] for n in ("chunk_size", "block_v", "block_k", "num_warps", "num_stages")}
    for point in a.states_out.split(","):
        out_bv, out_warps = (int(x) for x in point.lower().split("x"))
        if out_bv <= rows_cap:
            timed(dict(walk, out_block_v=out_bv, out_num_warps=out_warps))
    best = min(mine, key=lambda r: r["ms"])
    launch = {n: x for n, x in best.items() if n not in ("kernel", "ms", "max_error")}
    kernels = kernel_timeline(lambda: chunk_replay_states(q, k, v, beta, g=g, max_state_bytes=1 << 40, **launch))
    print("two-pass replay, best launch, kernel by kernel: "
          + ", ".join(f"{n[:40]} {us:.0f} us" for n, us in kernels), flush=True)
    best["kernels_us"] = kernels
    return [("two-pass chunked replay, best (" + ", ".join(f"{n}={x}" for n, x in launch.items()) + ")", best["ms"])]


def captured_errors(run_dir: str, json_path: str | None) -> dict:
    """Both replays of every call ``run_dir``'s capture stored, against the fp64 reference recurrence
    on the same device: the largest relative error (Frobenius, per field and call) over the calls."""
    from osdn_diag.capture.store import CaptureReader, to_device
    from osdn_diag.math import delta_rule_recurrence
    from osdn_diag.ops.replay import fused_replay
    from osdn_diag.ops.replay_chunk import chunk_replay
    from osdn_diag.replay.call import recurrence_inputs

    fields = ("o", "loss_before", "loss_after", "loss_before_decayed", "final_state")
    worst = {}
    calls = 0
    for stored in CaptureReader(run_dir):
        call = to_device(stored.call, "cuda")
        if call.g is not None and call.g.dim() == 4:
            continue
        inputs = recurrence_inputs(call, torch.float64, None)
        ref = delta_rule_recurrence(**inputs)
        inputs.pop("dtype")
        for name, run in (("fused", fused_replay), ("chunk", chunk_replay)):
            got = run(**inputs)
            for f in fields:
                if getattr(ref, f) is not None:
                    e = rel(getattr(got, f), getattr(ref, f))
                    worst[f"{name} {f}"] = max(worst.get(f"{name} {f}", 0.0), e)
        calls += 1
    shape = f"B={call.k.shape[0]} T={call.k.shape[1]} H={call.num_heads} K={call.k.shape[-1]} V={call.v.shape[-1]}"
    print(f"\ncaptured calls of {run_dir}: {calls} ({shape}), {torch.cuda.get_device_name()}")
    print("largest relative error against fp64, over the calls:")
    for n, e in worst.items():
        print(f"  {n:32s} {e:.2e}")
    result = {"run_dir": run_dir, "calls": calls, "shape": shape, "device": torch.cuda.get_device_name(),
              "worst_errors_vs_fp64": worst}
    write_json(json_path, result)
    return result


if __name__ == "__main__":
    main()
