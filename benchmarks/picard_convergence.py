"""How fast the token-parallel phase 1's Picard rounds converge, in fp64 on any device (CPU is fine).

    python benchmarks/picard_convergence.py [--T 4096 --K 128 --sequences 4] [--eta 0.003,0.03,0.3]

The token-parallel kernel (:mod:`osdn_diag.ops.phase1_parallel`) takes a first guess of every step size
``c_t`` from ``d`` frozen at ``d_0``; round ``r`` then walks the whole sequence under the step sizes of
round ``r − 1`` (emitting that walk's ``d``) and computes new ones from it. This script does the same
rounds exactly (no chunks, no fp32), on random unit keys and β ~ U(0, 1) as in ``bench_phase1.py``,
and prints per round how far the walk's ``d`` is from the exact sequential sweep
(:func:`osdn_diag.math.osdn_phase1`), beside the kernel's estimate of that error: the clamp is
1-Lipschitz, so a walk under step sizes off by ``δ_t`` is off by at most ``Σ_{j<t} |δ_j| s_j`` per
channel, with ``|c_next − c|`` standing in for ``δ``. The kernel calls a (sequence, head) settled when
twice the estimate's largest entry is at most ``TOL_D``. This is the evidence behind ``ROUNDS`` and
``TOL_D``; it times nothing.
"""

from __future__ import annotations

import argparse

import torch

from osdn_diag.math import osdn_phase1
from osdn_diag.ops.phase1_parallel import TOL_D


def _walk(c, s, d0, d_min, d_max):
    """``d_t`` for every token under fixed step sizes ``c [N, T]`` (``s [N, T, K]``): per channel, no
    coupling."""
    d, out = d0.clone(), torch.empty_like(s)
    for t in range(s.shape[1]):
        out[:, t] = d
        d = (d + c[:, t, None] * s[:, t]).clamp(d_min, d_max)
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--eta", default="0.003,0.03,0.3")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    gen = torch.Generator().manual_seed(a.seed)
    N, T, K = a.sequences, a.T, a.K
    k = torch.nn.functional.normalize(torch.randn(1, T, N, K, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.rand(1, T, N, generator=gen, dtype=torch.float64)
    s = (k * k)[0].transpose(0, 1)                      # [N, T, K]
    b = beta[0].transpose(0, 1)                         # [N, T]
    d0 = torch.ones(N, K, dtype=torch.float64)
    rows = []
    for eta in (float(e) for e in a.eta.split(",")):
        exact = osdn_phase1(k, beta, eta=eta).d[0].transpose(0, 1)  # [N, T, K]
        alpha = eta * b / s.sum(-1).clamp_min(1e-6)
        gam = alpha * b
        c = alpha - gam * (s * d0[:, None]).sum(-1)     # the first guess: d frozen at d_0
        settled = None
        print(f"\neta = {eta}: {N} sequences x {T} tokens, K = {K} (the kernel settles at 2 x estimate <= {TOL_D:g})")
        print(f"{'round':>5s} {'d error (relative)':>19s} {'estimate':>9s} {'d error (largest)':>18s} {'estimate':>9s}")
        for r in range(1, a.rounds + 1):
            d = _walk(c, s, d0, 0.5, 2.0)
            c_next = alpha - gam * (d * s).sum(-1)
            bound = torch.cumsum((c_next - c).abs()[..., None] * s, dim=1)
            err = float((d - exact).norm() / exact.norm())
            est = float(bound.norm() / exact.norm())
            err_max, est_max = float((d - exact).abs().max()), float(bound.max())
            if settled is None and 2 * est_max <= TOL_D:
                settled = r
            rows.append(dict(eta=eta, round=r, d_error=err, estimate=est, d_error_max=err_max,
                             estimate_max=est_max))
            print(f"{r:5d} {err:19.2e} {est:9.2e} {err_max:18.2e} {est_max:9.2e}")
            c = c_next
        print(f"the kernel's criterion settles at round {settled}" if settled else
              f"not settled in {a.rounds} rounds")
    return rows


if __name__ == "__main__":
    main()
