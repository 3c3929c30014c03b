"""OSDN / OSGDN layers against fla's DeltaNet / GatedDeltaNet layers, forward and forward+backward,
with the phase-1 kernel's share measured separately (GPU only).

    python benchmarks/bench_layers.py [--B 8 --T 4096 --H 8 --K 128] [--phase1 sequential,parallel]
                                      [--pairs osdn,osgdn] [--profile] [--json FILE]

bf16, hidden = H·K, K = V. Every pair is built with the same weights (the OSDN layer's state dict
is loaded into the fla layer), and before timing the pair's outputs at η = 0 are compared (OSDN at
η = 0 is DeltaNet). Kernel rows time the state update alone on the layer's own shapes: fla's
``chunk_delta_rule`` / ``chunk_gated_delta_rule``, our ``chunk_osdn`` (phase 2), ``osdn_precondition``
(phase 1), and fla's ``chunk_precond_gated_delta_rule`` (its own preconditioned delta rule) as the
overhead to beat. ``--phase1`` lists the phase-1 forward kernels to time the OSDN layers with
(``osdn_diag.ops.phase1.AUTO_METHOD``); rows are named ``OSDN[method]``. Times are
``triton.testing.do_bench`` medians in ms.
"""

from __future__ import annotations

import argparse
import platform

import torch
from _common import bench, rel, write_json


def _bench(fn, name: str) -> float:
    return bench(fn, name, warmup=10, rep=100)  # fewer repetitions than the kernel scripts: layers are slow


def _fwd_bwd(layer, x):
    def run():
        x.grad = None
        o = layer(x)[0]
        o.backward(torch.ones_like(o))

    return run


def _profile(name: str, fn) -> None:
    """Print where the GPU time of ``fn`` (no grad) goes, kernel by kernel, and the host's share."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
    print(f"\nprofile of {name} layer fwd, 10 calls:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def _pair(ours_cls, theirs_cls, hidden, H, K, eta, **kw):
    dev, bf16 = "cuda", torch.bfloat16
    torch.manual_seed(0)
    ours = ours_cls(hidden_size=hidden, num_heads=H, eta=eta, **kw).to(dev, bf16)
    theirs = theirs_cls(hidden_size=hidden, num_heads=H, **kw).to(dev, bf16)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    if missing:
        raise RuntimeError(f"{theirs_cls.__name__} has weights the OSDN layer lacks: {missing}")
    return ours, theirs


def layer_rows(a) -> tuple[dict, dict]:
    from fla.layers import DeltaNet, GatedDeltaNet

    from osdn_diag.layers import OSDN
    from osdn_diag.ops import phase1

    from osdn_diag.layers import OSGDN

    pairs = [("OSDN", "DeltaNet", OSDN, DeltaNet, {}),
             ("OSGDN", "GatedDeltaNet", OSGDN, GatedDeltaNet, {"head_dim": a.K, "expand_v": 1.0})]
    pairs = [pair for pair in pairs if pair[0].lower() in a.pairs.split(",")]
    B, T, H, K = a.B, a.T, a.H, a.K
    hidden = H * K
    x = torch.randn(B, T, hidden, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    rows, checks, errors = {}, {}, {}
    for ours_name, theirs_name, ours_cls, theirs_cls, kw in pairs:
        ours, theirs = _pair(ours_cls, theirs_cls, hidden, H, K, 0.0, **kw)
        with torch.no_grad():
            checks[f"{ours_name}(eta=0) vs {theirs_name}, bf16 rel"] = rel(ours(x)[0], theirs(x)[0])
        ours.eta = a.eta
        print(f"  check {ours_name}(eta=0) vs {theirs_name}: {checks[f'{ours_name}(eta=0) vs {theirs_name}, bf16 rel']:.2e}")
        variants = [(theirs_name, theirs, None)] + [(f"{ours_name}[{m}]", ours, m) for m in a.phase1.split(",")]
        for mode, make in (("fwd", None), ("fwd+bwd", _fwd_bwd)):
            for name, layer, method in variants:
                key = f"{name} layer {mode}"
                if method is not None:
                    phase1.AUTO_METHOD = method
                try:
                    if make is None:
                        with torch.no_grad():
                            rows[key] = _bench(lambda layer=layer: layer(x), key)
                    else:
                        rows[key] = _bench(make(layer, xg), key)
                except Exception as err:  # e.g. fla's gated backward refused on this GPU/triton
                    print(f"  {key}: not measured: {type(err).__name__}: {str(err)[:300]}")
                    errors[key] = f"{type(err).__name__}: {err}"
        if a.profile and ours_name == "OSDN":
            phase1.AUTO_METHOD = a.phase1.split(",")[-1]
            for name, layer in ((theirs_name, theirs), (ours_name, ours)):
                _profile(name, lambda layer=layer: layer(x))
        del ours, theirs
        torch.cuda.empty_cache()
    checks.update({f"not measured: {k}": v for k, v in errors.items()})
    return rows, checks


def kernel_rows(a) -> dict:
    from fla.ops.delta_rule import chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from osdn_diag.ops.osdn_chunk import chunk_osdn
    from osdn_diag.ops.phase1 import osdn_precondition

    dev, bf16 = "cuda", torch.bfloat16
    B, T, H, K = a.B, a.T, a.H, a.K
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
    q = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(bf16)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(bf16)
    v = rnd(B, T, H, K).to(bf16)
    beta = torch.rand(B, T, H, device=dev, generator=gen).to(bf16)
    g = -torch.rand(B, T, H, device=dev, generator=gen) * 0.1
    wk = osdn_precondition(k, beta, eta=a.eta)
    fns = {
        "fla chunk_delta_rule fwd": lambda: chunk_delta_rule(q, k, v, beta),
        "chunk_osdn fwd (phase 2)": lambda: chunk_osdn(q, k, v, beta, wk),
    }
    if "osgdn" in a.pairs.split(","):
        fns["fla chunk_gated_delta_rule fwd"] = lambda: chunk_gated_delta_rule(q, k, v, g, beta)
        fns["chunk_osdn gated fwd (phase 2)"] = lambda: chunk_osdn(q, k, v, beta, wk, g=g)
    for m in a.phase1.split(","):
        fns[f"osdn_precondition fwd (phase 1, {m})"] = (
            lambda m=m: osdn_precondition(k, beta, eta=a.eta, validate=False, method=m))
    rows = {name: _bench(fn, name) for name, fn in fns.items()}
    try:
        from fla.ops.precond_gated_delta_rule import chunk_precond_gated_delta_rule

        g_atk = -torch.rand(B, T, H, device=dev, generator=gen) * 0.1
        beta_atk = torch.rand(B, T, H, device=dev, generator=gen)
        rows["fla chunk_precond_gated_delta_rule fwd"] = _bench(
            lambda: chunk_precond_gated_delta_rule(q, k, v, g_atk, g, beta_atk, beta),
            "fla chunk_precond_gated_delta_rule fwd",
        )
    except Exception as err:  # its signature differs between fla versions: report, do not fail
        print(f"fla precond kernel not timed: {type(err).__name__}: {err}")
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("B", 8), ("T", 4096), ("H", 8), ("K", 128)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--eta", type=float, default=0.003)
    p.add_argument("--phase1", default="sequential,parallel", help="phase-1 forward kernels to time")
    p.add_argument("--pairs", default="osdn,osgdn", help="which layer pairs: osdn (vs DeltaNet), osgdn")
    p.add_argument("--profile", action="store_true", help="print a kernel-by-kernel profile of the forwards")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_layers needs a CUDA GPU")

    layers, checks = layer_rows(a)
    kernels = kernel_rows(a)
    print(f"\nB={a.B} T={a.T} H={a.H} K=V={a.K} bf16, eta={a.eta}, {torch.cuda.get_device_name()}")
    for name, err in checks.items():
        print(f"check: {name} = {err:.2e}" if isinstance(err, float) else f"{name}: {err[:200]}")
    print(f"\n{'layer':34s} {'ms':>9s} {'vs fla':>8s}")
    for ours, theirs in (("OSDN", "DeltaNet"), ("OSGDN", "GatedDeltaNet")):
        for mode in ("fwd", "fwd+bwd"):
            b_ms = layers.get(f"{theirs} layer {mode}")
            if b_ms is None:
                continue
            print(f"{theirs + ' layer ' + mode:34s} {b_ms:9.3f} {'1.00x':>8s}")
            for m in a.phase1.split(","):
                a_ms = layers.get(f"{ours}[{m}] layer {mode}")
                if a_ms is not None:
                    print(f"{ours + '[' + m + '] layer ' + mode:34s} {a_ms:9.3f} {a_ms / b_ms:7.2f}x")
    base = kernels["fla chunk_delta_rule fwd"]
    print(f"\n{'kernel (fwd)':42s} {'ms':>9s} {'vs chunk_delta_rule':>20s}")
    for name, ms in kernels.items():
        print(f"{name:42s} {ms:9.3f} {ms / base:19.2f}x")
    for m in a.phase1.split(","):
        osdn_kernel = kernels["chunk_osdn fwd (phase 2)"] + kernels[f"osdn_precondition fwd (phase 1, {m})"]
        print(f"{'OSDN phase 1 (' + m + ') + phase 2':42s} {osdn_kernel:9.3f} {osdn_kernel / base:19.2f}x")
    result = {
        "shape": dict(B=a.B, T=a.T, H=a.H, K=a.K, dtype="bf16", eta=a.eta),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "host": platform.node(),
        "phase1_methods": a.phase1.split(","),
        "checks": checks,
        "layers_ms": layers,
        "kernels_ms": kernels,
    }
    write_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
