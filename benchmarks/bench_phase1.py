"""OSDN phase 1 (the Triton preconditioner sweep) against phase 2 (fla's ``chunk_delta_rule``) on the
same shape, measured in the same run (GPU only).

    python benchmarks/bench_phase1.py [--B 8 --T 4096 --H 8 --K 128] [--sweep] [--json FILE]

Phase 1 has two forward kernels, measured side by side: the sequential sweep over T (one program per
sequence×head, the layers' default) and the token-parallel one (:mod:`osdn_diag.ops.phase1_parallel`:
Picard rounds over whole sequences), the latter also at larger η (more rounds; past its round budget
the sequential kernel answers). Phase 2 is fla's chunked delta rule with q, k, v bf16. The target is
phase 1 ≤ 25 % of phase 2. Before timing, the kernel is checked against the fp64 reference
(``osdn_phase1`` and torch.autograd through it) at the benchmark shape. Times are
``triton.testing.do_bench`` medians; a second table splits the forwards into GPU work (the kernels'
device time, torch profiler) and host time (issuing one call), since the wall time of a kernel with
many launches is the host's when the host is slower. A third table lists the token-parallel
forward's kernels in launch order with their device time; ``--sweep`` adds its GPU time over chunk
sizes and the first round that writes k̃ (``emit_from``).
"""

from __future__ import annotations

import argparse
import platform

import torch
from _common import bench, device_and_host_ms, kernel_timeline, rel, write_json


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("B", 8), ("T", 4096), ("H", 8), ("K", 128)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--eta", type=float, default=0.003)
    p.add_argument("--T-grad", type=int, default=256, help="tokens in the gradient check")
    p.add_argument("--sweep", action="store_true", help="the token-parallel forward over chunk and emit_from")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_phase1 needs a CUDA GPU")

    from osdn_diag.math import osdn_phase1
    from osdn_diag.ops.osdn_recurrent import fused_recurrent_osdn
    from osdn_diag.ops.phase1 import osdn_precondition

    dev, bf16 = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    B, T, H, K = a.B, a.T, a.H, a.K
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(bf16)
    q = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(bf16)
    v = rnd(B, T, H, K).to(bf16)
    beta = torch.rand(B, T, H, device=dev, generator=gen).to(bf16)
    dwk = rnd(B, T, H, K).to(bf16)
    kw = dict(eta=a.eta)

    # Correctness against fp64 on the bf16-rounded inputs, same device: the forward at the full shape;
    # the gradients on the first --T-grad tokens (autograd through the reference's per-token slice
    # assignments costs O(T²) memory traffic).
    errors = {}
    with torch.no_grad():
        ref = osdn_phase1(k.double(), beta.double(), **kw)
        for method in ("sequential", "parallel"):
            got = osdn_precondition(k, beta, **kw, return_trajectory=True, method=method)
            errors[f"{method}: write_key (bf16 out)"] = rel(got.write_key, ref.write_key)
            errors[f"{method}: d (fp32)"] = rel(got.d, ref.d)
            errors[f"{method}: d_final (fp32)"] = rel(got.d_final, ref.d_final)
        del ref, got
    Tg = min(T, a.T_grad)
    k64 = k[:, :Tg].double().requires_grad_(True)
    b64 = beta[:, :Tg].double().requires_grad_(True)
    ref_wk = osdn_phase1(k64, b64, **kw).write_key
    ref_dk, ref_db = torch.autograd.grad(ref_wk, (k64, b64), grad_outputs=dwk[:, :Tg].double())
    kg = k[:, :Tg].clone().requires_grad_(True)
    bg = beta[:, :Tg].clone().requires_grad_(True)
    dk, db = torch.autograd.grad(osdn_precondition(kg, bg, **kw), (kg, bg), grad_outputs=dwk[:, :Tg])  # auto
    errors[f"grad k (bf16 out, T={Tg})"] = rel(dk, ref_dk)
    errors[f"grad beta (bf16 out, T={Tg})"] = rel(db, ref_db)
    del k64, b64, ref_wk, ref_dk, ref_db, dk, db
    kg, bg = k.clone().requires_grad_(True), beta.clone().requires_grad_(True)

    def phase1_bwd(method="sequential"):
        wk = osdn_precondition(kg, bg, **kw, validate=False, method=method)
        torch.autograd.grad(wk, (kg, bg), grad_outputs=dwk)

    from osdn_diag.ops.phase1_parallel import parallel_fwd

    def parallel(eta, stats=None, store_d=False, **kw):
        return parallel_fwd(k, beta, None, None, None, B, eta, 0.5, 2.0, True, 1e-6, store_d, stats=stats, **kw)

    settling = {}
    with torch.no_grad():
        for eta in (a.eta, 0.03, 0.3):
            parallel(eta, settling.setdefault(eta, {}))
            print(f"token-parallel phase 1 at eta={eta}: {settling[eta]}")
    timed = {
        "phase1 sequential fwd": lambda: osdn_precondition(k, beta, **kw, validate=False, method="sequential"),
        "phase1 parallel fwd": lambda: osdn_precondition(k, beta, **kw, validate=False, method="parallel"),
        "phase1 parallel fwd, eta 0.03": lambda: parallel(0.03),
        "phase1 parallel fwd, eta 0.3": lambda: parallel(0.3),
        "phase1 fwd (auto), with argument checks": lambda: osdn_precondition(k, beta, **kw),
        "phase1 fwd (auto) + trajectory": lambda: osdn_precondition(k, beta, **kw, validate=False,
                                                                    return_trajectory=True),
        # Both phases in one recurrent kernel (the layers' inference path for short inputs), for scale.
        "fused recurrent OSDN, phases 1 + 2": lambda: fused_recurrent_osdn(q, k, v, beta, **kw, validate=False),
        "phase1 sequential fwd+bwd": phase1_bwd,
        "phase1 parallel fwd+bwd": lambda: phase1_bwd("parallel"),
    }
    rows = {name: bench(fn, name) for name, fn in timed.items()}
    phase2 = {}
    try:
        from fla.ops.delta_rule import chunk_delta_rule

        phase2["fwd"] = bench(lambda: chunk_delta_rule(q, k, v, beta), "fla chunk_delta_rule fwd")
        qg, kg2, vg, bg2 = (x.clone().requires_grad_(True) for x in (q, k, v, beta))

        def phase2_bwd():
            o, _ = chunk_delta_rule(qg, kg2, vg, bg2)
            torch.autograd.grad(o, (qg, kg2, vg, bg2), grad_outputs=v)

        phase2["fwd+bwd"] = bench(phase2_bwd, "fla chunk_delta_rule fwd+bwd")
        rows["fla chunk_delta_rule fwd (phase 2)"] = phase2["fwd"]
        rows["fla chunk_delta_rule fwd+bwd (phase 2)"] = phase2["fwd+bwd"]
    except ImportError as e:
        print(f"fla not importable ({e}): no phase-2 baseline")

    print(f"\nOSDN phase 1, B={B} T={T} H={H} K={K} bf16, eta={a.eta}, {torch.cuda.get_device_name()}")
    print("vs fp64 reference, relative error: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    print(f"{'what':42s} {'ms':>9s} {'vs phase 2':>11s}")
    for name, ms in rows.items():
        base = phase2.get("fwd+bwd" if "bwd" in name else "fwd")
        ratio = f"{100 * ms / base:9.1f} %" if base and "phase 2" not in name else "          -"
        print(f"{name:42s} {ms:9.3f} {ratio:>11s}")
    # Wall time is paced by the host where it issues kernels more slowly than the GPU runs them, and
    # hosts differ: the GPU's share of the work, beside it, is the host-independent figure.
    split = {name: device_and_host_ms(timed[name]) for name in ("phase1 sequential fwd", "phase1 parallel fwd")}
    if phase2:
        split["fla chunk_delta_rule fwd (phase 2)"] = device_and_host_ms(lambda: chunk_delta_rule(q, k, v, beta))

    def gpu_share(gpu_ms: float) -> str:
        base = split.get("fla chunk_delta_rule fwd (phase 2)")
        return f"{100 * gpu_ms / base[0]:13.1f} %" if base else "              -"

    print(f"\n{'forward':42s} {'GPU ms':>9s} {'host ms':>9s} {'GPU vs phase 2':>15s}")
    for name, (dev_ms, host_ms) in split.items():
        ratio = gpu_share(dev_ms) if "phase 2" not in name else "              -"
        print(f"{name:42s} {dev_ms:9.3f} {host_ms:9.3f} {ratio:>15s}")
    timeline = kernel_timeline(lambda: parallel(a.eta))
    print(f"\n{'token-parallel forward, kernel by kernel':42s} {'GPU us':>9s}")
    for name, us in timeline:
        print(f"{name[:42]:42s} {us:9.1f}")
    print(f"{'total':42s} {sum(us for _, us in timeline):9.1f}")
    sweep = {}
    if a.sweep:
        print(f"\n{'token-parallel forward':42s} {'GPU ms':>9s} {'rounds':>7s} {'GPU vs phase 2':>15s}")
        for chunk in (64, 128, 256):
            for emit_from in (1, 2):
                st = {}
                with torch.no_grad():
                    parallel(a.eta, st, chunk=chunk, emit_from=emit_from)
                dev_ms, _ = device_and_host_ms(lambda: parallel(a.eta, chunk=chunk, emit_from=emit_from))
                name = f"chunk {chunk}, emit_from {emit_from}"
                sweep[name] = {"gpu_ms": dev_ms, **st}
                print(f"{name:42s} {dev_ms:9.3f} {st['rounds']:7d} {gpu_share(dev_ms):>15s}")
    result = {
        "shape": dict(B=B, T=T, H=H, K=K, dtype="bf16", eta=a.eta),
        "device_and_host_ms": split,
        "parallel_kernels_us": timeline,
        "parallel_sweep": sweep,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "host": platform.node(),
        "errors_vs_fp64": errors,
        "ms": rows,
        "settling": {str(e): v for e, v in settling.items()},
        "ratio_phase1_over_phase2": {
            "sequential fwd": rows["phase1 sequential fwd"] / phase2["fwd"] if phase2 else None,
            "sequential fwd+bwd": rows["phase1 sequential fwd+bwd"] / phase2["fwd+bwd"] if phase2 else None,
            "parallel fwd": rows["phase1 parallel fwd"] / phase2["fwd"] if phase2 else None,
            "parallel fwd+bwd": rows["phase1 parallel fwd+bwd"] / phase2["fwd+bwd"] if phase2 else None,
        },
    }
    write_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
