"""Capture on the GPU: fidelity of every adapter at real shapes, capture overhead, end-to-end run.

    python benchmarks/bench_capture.py [--T 2048] [--json FILE]

1. Fidelity: one fla layer per kernel family at the paper's 340M width (hidden 1024, 8 heads),
   T tokens, bf16 and fp32, chunk and fused-recurrent paths; the captured call is replayed with the
   Triton backend and the relative output error against the kernel's own output is reported, with
   the final-state error against the kernel's fp32 final state (and in units of the kernel's
   working-precision rounding), and max |‖k‖² − 1| of the keys as the kernel read them.
2. Overhead: forward time of the random 340M DeltaNet preset (bf16, 2 × T tokens) with and without
   capture (records kept in GPU memory).
3. End to end: capture + replay + summary of the same model on 2 prompts × T tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from _common import fidelity_text, write_json


def _layer(name: str, hidden: int):
    from fla.layers import DeltaNet, GatedDeltaNet, KimiDeltaAttention, PrecondGatedDeltaNet
    from fla.layers.precond_kda import PrecondKDA

    return {
        "delta_net": lambda: DeltaNet(hidden_size=hidden, num_heads=8, layer_idx=0),
        "gated_deltanet": lambda: GatedDeltaNet(hidden_size=hidden, num_heads=8, head_dim=128, expand_v=1, layer_idx=0),
        "kda": lambda: KimiDeltaAttention(hidden_size=hidden, num_heads=8, head_dim=128, layer_idx=0),
        "precond_gated_deltanet": lambda: PrecondGatedDeltaNet(hidden_size=hidden, num_heads=8, head_dim=128, expand_v=1, layer_idx=0),
        "precond_kda": lambda: PrecondKDA(hidden_size=hidden, num_heads=8, head_dim=128, layer_idx=0),
    }[name]()


FAMILIES = ("delta_net", "gated_deltanet", "kda", "precond_gated_deltanet", "precond_kda")


def fidelity(T: int, families=FAMILIES, dtypes=("bfloat16", "float32"), lengths=None) -> list[dict]:
    from osdn_diag.capture.context import capture
    from osdn_diag.replay import replay_call

    rows = []
    for name in families:
        for dtype in (getattr(torch, d) for d in dtypes):
            for length in lengths or (T, 48):  # chunk path, and the fused-recurrent path
                if name == "delta_net" and dtype == torch.float32 and length > 64:
                    continue  # fla refuses fp32 in chunk_delta_rule
                torch.manual_seed(0)
                layer = _layer(name, 1024).to("cuda", dtype).eval()
                x = torch.randn(2, length, 1024, device="cuda", dtype=dtype)
                with torch.no_grad():
                    off = layer(x)[0]
                    with capture(layer, kernels="fla") as cap:
                        on = layer(x)[0]
                call = cap.calls[0]
                err, res = {}, None
                for backend in ("triton", "torch"):
                    res = replay_call(call, backend=backend, tolerance=float("inf"))
                    err[backend] = res.fidelity
                k2 = call.k.double().square().sum(-1)
                rows.append(
                    dict(layer=name, dtype=str(dtype).removeprefix("torch."), T=length, kernel=call.kernel,
                         identical=bool(torch.equal(on, off)), fidelity_triton=err["triton"],
                         fidelity_torch=err["torch"],
                         state_error=float("nan") if res.state_fidelity is None else res.state_fidelity,
                         state_rounding_units=res.state_rounding_units or float("nan"),
                         qk_read_as=call.flags.get("qk_read_as"),
                         max_unit_dev=float((k2 - 1).abs().max()))
                )
                r = rows[-1]
                print(f"{name:24s} {r['dtype']:9s} T={length:5d} {call.kernel:42s} "
                      f"identical={r['identical']!s:5s} err triton {err['triton']:.2e} torch {err['torch']:.2e} "
                      f"state {r['state_error']:.2e} ({r['state_rounding_units']:.3g} units) "
                      f"|k2-1| {r['max_unit_dev']:.1e} keys {r['qk_read_as']}", flush=True)
    return rows


def _time(fn, reps=10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def overhead(T: int) -> dict:
    from osdn_diag.capture.context import capture
    from osdn_diag.models import load_model

    model = load_model("random:deltanet-340m", device="cuda", dtype=torch.bfloat16).model
    ids = torch.randint(0, 32000, (2, T), device="cuda")
    with torch.inference_mode():
        plain = _time(lambda: model(ids, use_cache=False))
        with capture(model, kernels="fla") as cap:
            def fwd():
                cap.calls.clear()
                model(ids, use_cache=False)
            captured = _time(fwd)
    out = dict(forward_ms=plain, forward_with_capture_ms=captured, overhead=captured / plain - 1)
    print(f"340M forward 2x{T}: {plain:.1f} ms, with capture {captured:.1f} ms, overhead {100 * out['overhead']:.1f} %")
    return out


def end_to_end(T: int) -> dict:
    from osdn_diag.pipeline import capture_run, replay_run

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        capture_run("random:deltanet-340m", "random", d, num_prompts=2, length=T, progress=False)
        t1 = time.perf_counter()
        summary = replay_run(d, progress=False)
        t2 = time.perf_counter()
    out = dict(capture_s=t1 - t0, replay_s=t2 - t1, q_geo=summary["q_geo"], n=summary["n"],
               fidelity=summary["fidelity"]["max_rel_error"])
    print(f"run random:deltanet-340m, 2 x {T}: capture {out['capture_s']:.1f} s (incl. model load), "
          f"replay+summary {out['replay_s']:.1f} s, n = {out['n']:,}, q_geo = {out['q_geo']:.4f}, "
          f"fidelity {fidelity_text(out['fidelity'])}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--parts", default="fidelity,overhead,end_to_end")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--lengths", help="comma-separated T values for the fidelity part (default: T,48)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for part in a.parts.split(","):
        if part == "fidelity":
            lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else None
            result[part] = fidelity(a.T, a.families.split(","), a.dtypes.split(","), lengths)
        else:
            result[part] = {"overhead": overhead, "end_to_end": end_to_end}[part](a.T)
        write_json(a.json, result)  # after every part, so a run cut short keeps what it measured


if __name__ == "__main__":
    main()
