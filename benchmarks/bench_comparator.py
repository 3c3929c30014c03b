"""Comparator gap ε_T^diag at scale: the batched box-constrained least-squares solver of
``osdn_diag.metrics.comparator`` on synthetic streams, checked against scipy on a subsample.

    python benchmarks/bench_comparator.py [--P 9216 --T 2048 --K 128] [--json FILE]

The default shape is the paper's (48 prompts × 24 layers × 8 heads, T = 2,048, K = 128; target ≤ 10 s
on one H200). Keys are unit-norm fp32 with a per-problem log-normal channel scale (``--skew``, so some
coordinates of d* sit on the box and some inside), β = sigmoid(N(0, 1)) and a share ``--invalid`` of
tokens masked out. Prints the time of each phase (normal equations, solve, value re-evaluation),
problems/s, the solver's certificates and the agreement with ``scipy.optimize.lsq_linear`` (BVLS) on
``--check`` problems; ``--json`` writes the same numbers.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _common import write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def make_inputs(P, T, K, *, skew, invalid, dev, seed=0, chunk=256):
    """Unit keys ``[P, T, K]`` (fp32), β ``[P, T]``, mask ``[P, T]``; ``chunk`` problems at a time."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    k = torch.empty(P, T, K, device=dev)
    for p0 in range(0, P, chunk):
        p1 = min(P, p0 + chunk)
        x = torch.randn(p1 - p0, T, K, device=dev, generator=gen)
        x *= torch.exp(skew * torch.randn(p1 - p0, 1, K, device=dev, generator=gen))
        k[p0:p1] = torch.nn.functional.normalize(x, dim=-1)
    beta = torch.sigmoid(torch.randn(P, T, device=dev, generator=gen))
    mask = torch.rand(P, T, device=dev, generator=gen) >= invalid
    return k, beta, mask


def scipy_check(k, beta, mask, res, idx, lo, hi):
    """BVLS on problems ``idx`` (CPU, fp64) → agreement numbers and scipy's own time per problem."""
    from scipy.optimize import lsq_linear

    from osdn_diag.metrics.comparator import comparator_gap_masked

    diffs, rels, cert_ok, t_sp = [], [], True, 0.0
    for i in idx:
        kk, bb, mm = k[i].double().cpu(), beta[i].double().cpu(), mask[i].cpu()
        n = int(mm.sum())
        A = (bb[mm][:, None] * kk[mm] ** 2).numpy() / np.sqrt(max(n, 1))
        b = np.full(n, 1.0 / np.sqrt(max(n, 1)))
        t0 = time.perf_counter()
        x = np.ones(kk.shape[-1])
        if n:
            x = lsq_linear(A, b, bounds=(lo, hi), method="bvls", tol=1e-14, lsq_solver="exact").x
        t_sp += time.perf_counter() - t0
        x = torch.from_numpy(np.clip(x, lo, hi))[None]
        ref = float(comparator_gap_masked(x, kk[None], bb[None], mm[None]))
        ours, gap = float(res.value[i]), float(res.gap[i])
        diffs.append(ours - ref)
        rels.append(abs(ours - ref) / max(ref, 1e-300))
        cert_ok &= gap >= ours - ref - 1e-12
    return {
        "n": len(idx),
        "max_value_minus_scipy": max(diffs),
        "min_value_minus_scipy": min(diffs),
        "max_rel_diff": max(rels),
        "gap_certifies": bool(cert_ok),
        "scipy_s_per_problem": t_sp / max(len(idx), 1),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("P", 9216), ("T", 2048), ("K", 128)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--d-min", type=float, default=0.5)
    p.add_argument("--d-max", type=float, default=2.0)
    p.add_argument("--skew", type=float, default=1.0, help="std of the log channel scale of the keys")
    p.add_argument("--invalid", type=float, default=0.01, help="share of masked-out tokens")
    p.add_argument("--check", type=int, default=32, help="problems checked against scipy")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)

    from osdn_diag.metrics.comparator import comparator_gap_masked, normal_equations, solve_box_lsq

    dev = torch.device(a.device)
    P, T, K, lo, hi = a.P, a.T, a.K, a.d_min, a.d_max
    k, beta, mask = make_inputs(P, T, K, skew=a.skew, invalid=a.invalid, dev=dev)

    def run(kk, bb, mm):
        _sync(dev)
        t0 = time.perf_counter()
        G, c, c0, _ = normal_equations(kk, bb, mm)
        _sync(dev)
        t1 = time.perf_counter()
        res = solve_box_lsq(G, c, c0, d_min=lo, d_max=hi)
        _sync(dev)
        t2 = time.perf_counter()
        res.value = comparator_gap_masked(res.d, kk, bb, mm)  # as comparator_gap_diag does
        _sync(dev)
        t3 = time.perf_counter()
        del G, c, c0
        return res, (t1 - t0, t2 - t1, t3 - t2)

    w = min(P, 64)
    run(k[:w], beta[:w], mask[:w])  # warm-up (kernels, solver handles)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    res, (t_ne, t_solve, t_val) = run(k, beta, mask)
    total = t_ne + t_solve + t_val
    idx = np.unique(np.linspace(0, P - 1, min(a.check, P)).round().astype(int)).tolist()
    try:
        check = scipy_check(k, beta, mask, res, idx, lo, hi) if a.check > 0 else None
    except ImportError as e:  # scipy missing on this machine
        print(f"scipy check skipped: {e}")
        check = None

    on_bound = ((res.d == lo) | (res.d == hi)).double().mean().item()
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    threads = "" if dev.type == "cuda" else f", {torch.get_num_threads()} threads"
    print(f"\ncomparator gap, P={P} T={T} K={K} box [{lo}, {hi}], skew {a.skew}, invalid {a.invalid}, "
          f"{device_name}, torch {torch.__version__}{threads}")
    print(f"{'phase':34s} {'s':>9s} {'problems/s':>12s}")
    for name, s in (("normal equations (fp64)", t_ne), ("solve (projection + Newton)", t_solve),
                    ("value from the stream", t_val), ("total = comparator_gap_diag", total)):
        print(f"{name:34s} {s:9.3f} {P / s:12.1f}")
    print(f"iterations {res.iterations}, converged {res.converged.double().mean().item():.4f}, "
          f"max gap {res.gap.max().item():.2e}, max kkt residual {res.kkt_residual.max().item():.2e}, "
          f"share of d* on the box {on_bound:.3f}, median eps_diag {res.value.median().item():.4g}")
    if check:
        c, sp = check, check["scipy_s_per_problem"]
        print(f"vs scipy BVLS on {c['n']} problems: value − scipy in [{c['min_value_minus_scipy']:.2e}, "
              f"{c['max_value_minus_scipy']:.2e}], max relative difference {c['max_rel_diff']:.2e}, "
              f"gap certifies: {c['gap_certifies']}; scipy {sp * 1e3:.1f} ms/problem ({P * sp:.0f} s for all P)")
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    if peak is not None:
        inputs = (k.numel() * 4 + beta.numel() * 5) / 2**30
        print(f"peak GPU memory {peak:.1f} GiB (inputs {inputs:.1f} GiB)")
    result = {
        "shape": dict(P=P, T=T, K=K),
        "box": [lo, hi],
        "skew": a.skew,
        "invalid": a.invalid,
        "device": device_name,
        "torch": torch.__version__,
        "host": platform.node(),
        "seconds": {"normal_equations": t_ne, "solve": t_solve, "value": t_val, "total": total},
        "problems_per_s": P / total,
        "iterations": res.iterations,
        "converged_share": res.converged.double().mean().item(),
        "max_gap": res.gap.max().item(),
        "max_kkt_residual": res.kkt_residual.max().item(),
        "share_on_bound": on_bound,
        "scipy": check,
        "peak_gpu_gib": peak,
    }
    write_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
