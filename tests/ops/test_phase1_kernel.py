"""The phase-1 Triton kernels (forward sweep, reverse sweep) against the fp64 reference
:func:`osdn_diag.math.phase1.osdn_phase1` and torch.autograd through it.

CPU: Triton's interpreter (set below, before triton is imported; the root conftest may do this
centrally later). GPU: the compiled kernels. Shapes are tiny: the interpreter costs per program and per
token, and the whole module should stay well under a minute on two cores.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from osdn_diag.math import osdn_phase1  # noqa: E402

ops_phase1 = pytest.importorskip("osdn_diag.ops.phase1", reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64


def _inputs(seed, B, T, H, K, *, retention=None, d0=None, N=None, pinned=False):
    """Unit keys with the awkward cases planted: a zero and a tiny key, β ≈ 0 and β ≈ 1 (fp64, CPU)."""
    gen = torch.Generator().manual_seed(seed)
    N = B if N is None else N
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    k[:, 0, 0] = 0.0
    # A tiny key, ‖k‖² = 1e-8 < ε: n_t is floored and must pass no gradient to ‖k‖².
    k[:, min(1, T - 1), -1] *= 1e-4
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    beta[:, T // 2] = 1e-6  # [B, T, H]: token T/2 of every head
    beta[:, -1] = 1 - 1e-6
    kw = {}
    if retention == "head":
        kw["retention"] = 0.7 + 0.3 * torch.rand(B, T, H, generator=gen, dtype=F64)
    elif retention == "channel":
        kw["retention"] = 0.7 + 0.3 * torch.rand(B, T, H, K, generator=gen, dtype=F64)
    if d0 is not None:
        shape = (H, K) if d0 == "shared" else (N, H, K)
        kw["d0"] = 0.6 + 1.3 * torch.rand(*shape, generator=gen, dtype=F64)
        if pinned:
            # Coordinates exactly at the bounds: with the zero key at t = 0 (and r ≡ 1), d̄ = d lands
            # on the bound exactly, which is where the clamp's gradient convention matters.
            kw["d0"][..., 0] = 0.5
            kw["d0"][..., 1] = 2.0
    return k, beta, kw


def _dev(kw, dtype=None):
    return {n: (x.to(DEVICE) if dtype is None else x.to(DEVICE, dtype)) for n, x in kw.items()}


def _rel(got, ref):
    return ((got.detach().double().cpu() - ref.detach()).norm() / ref.detach().norm().clamp_min(1e-300)).item()


def _assert_close(got, ref, name, tol):
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = _rel(got, ref)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"


def _check_forward(got, ref, tol, wk_dtype):
    assert got.write_key.dtype == wk_dtype
    # fp32 trajectory, fp64 for fp64 keys (the reference's compute-dtype rule)
    assert got.d.dtype == got.d_final.dtype == (F64 if wk_dtype == F64 else torch.float32)
    for name in ("write_key", "d", "d_final"):
        _assert_close(getattr(got, name), getattr(ref, name), name, tol)


FORWARD_CASES = {
    # id: (B, T, H, K, retention, d0, options)
    "T1": (1, 1, 1, 8, None, None, {}),
    "K12-head-shared": (2, 13, 2, 12, "head", "shared", {"eta": 0.5}),
    "channel-perseq-clamp": (2, 10, 1, 16, "channel", "perseq", {"eta": 5.0}),
    "nobox": (1, 9, 2, 8, None, "shared", {"eta": 3.0, "d_min": None, "d_max": None}),
    "beta-unaware": (2, 7, 1, 8, None, None, {"eta": 2.0, "beta_aware": False}),
}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (F64, 1e-12)])
@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_matches_reference(case, dtype, tol):
    B, T, H, K, ret, d0, opts = FORWARD_CASES[case]
    k, beta, kw = _inputs(sum(map(ord, case)), B, T, H, K, retention=ret, d0=d0)
    ref = osdn_phase1(k, beta, **kw, **opts)
    got = ops_phase1.osdn_precondition(
        k.to(DEVICE, dtype), beta.to(DEVICE, dtype), **_dev(kw, dtype), **opts, return_trajectory=True
    )
    _check_forward(got, ref, tol, dtype)
    if case == "channel-perseq-clamp":  # the test must actually exercise the projection
        at_bound = ((ref.d == 0.5) | (ref.d == 2.0)).double().mean().item()
        assert at_bound > 0.1, at_bound
    if case == "nobox":
        assert bool((ref.d > 2.0).any() or (ref.d < 0.5).any())  # a box would have bound


def test_forward_write_key_emitted_before_update():
    """k̃_t = d_t ⊙ k_t with d_t the state *before* token t's step: at t = 0 that is exactly d0."""
    k, beta, kw = _inputs(5, 1, 3, 1, 8, d0="shared")
    got = ops_phase1.osdn_precondition(
        k.to(DEVICE, torch.float32), beta.to(DEVICE, torch.float32), **_dev(kw, torch.float32), eta=1.0
    )
    expect = kw["d0"][0].float() * k[0, 0, 0].float()
    torch.testing.assert_close(got[0, 0, 0].cpu(), expect, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_half_inputs(dtype):
    """bf16/fp16 keys and gates, fp32 accumulation: within 1e-2 of fp64 on the rounded inputs."""
    k, beta, kw = _inputs(11, 2, 12, 2, 12, retention="channel", d0="shared")
    k, beta = k.to(dtype), beta.to(dtype)
    kw = {n: x.to(dtype) for n, x in kw.items()}
    ref = osdn_phase1(k.double(), beta.double(), **{n: x.double() for n, x in kw.items()}, eta=0.5)
    got = ops_phase1.osdn_precondition(
        k.to(DEVICE), beta.to(DEVICE), **_dev(kw), eta=0.5, return_trajectory=True
    )
    _check_forward(got, ref, 1e-2, dtype)


def test_forward_packed_sequences():
    """cu_seqlens with an empty and a length-1 segment: d restarts from d0[n] at every boundary, and an
    empty segment's d_final is its d0."""
    cu = torch.tensor([0, 6, 6, 7, 15])
    k, beta, kw = _inputs(3, 1, 15, 2, 12, retention="head", d0="perseq", N=4)
    ref = osdn_phase1(k, beta, **kw, eta=2.0, cu_seqlens=cu)
    got = ops_phase1.osdn_precondition(
        k.to(DEVICE, torch.float32), beta.to(DEVICE, torch.float32), **_dev(kw, torch.float32),
        eta=2.0, cu_seqlens=cu.to(DEVICE), return_trajectory=True,
    )
    _check_forward(got, ref, 1e-5, torch.float32)
    torch.testing.assert_close(got.d_final[1].cpu(), kw["d0"][1].float(), rtol=0, atol=0)


def test_forward_without_grad_skips_trajectory():
    k, beta, kw = _inputs(2, 2, 5, 1, 8)
    args = (k.to(DEVICE, torch.float32), beta.to(DEVICE, torch.float32))
    wk = ops_phase1.osdn_precondition(*args, eta=0.5)
    full = ops_phase1.osdn_precondition(*args, eta=0.5, return_trajectory=True)
    assert isinstance(wk, torch.Tensor)
    assert torch.equal(wk, full.write_key)


# --- backward -----------------------------------------------------------------------------------

BACKWARD_CASES = {
    # id: (B, T, H, K, retention, d0, cu_seqlens, options)
    "plain": (2, 9, 2, 12, None, None, None, {"eta": 0.5}),
    "head-shared-pinned": (2, 8, 2, 8, "head", "shared-pinned", None, {"eta": 1.0}),
    "channel-perseq-clamp": (2, 8, 1, 8, "channel", "perseq", None, {"eta": 5.0}),
    "nobox-unaware": (1, 7, 2, 12, None, "shared", None, {"eta": 0.3, "d_min": None,
                                                          "d_max": None, "beta_aware": False}),
    "varlen": (1, 12, 1, 8, "channel", "perseq", [0, 5, 5, 6, 12], {"eta": 2.0}),
    "pinned-noret": (1, 6, 1, 8, None, "shared-pinned", None, {"eta": 1.0}),
}


def _loss(res, w):
    return sum((getattr(res, n) * w[n].to(getattr(res, n).dtype)).sum() for n in ("write_key", "d", "d_final"))


def _run_grads(fn, inputs, opts, weights, cast):
    leaves = {n: cast(x).detach().requires_grad_(True) for n, x in inputs.items()}
    args = {n: x for n, x in leaves.items() if n not in ("k", "beta")}
    res = fn(leaves["k"], leaves["beta"], **args, **opts)
    grads = torch.autograd.grad(_loss(res, weights), list(leaves.values()), allow_unused=True)
    return dict(zip(leaves, grads))


@pytest.mark.parametrize("method", ["sequential", "parallel"])
@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_backward_matches_autograd_through_reference(case, method, fla_kernels, monkeypatch):
    """The reverse sweep over the trajectory of either forward kernel (the token-parallel one's
    backward is the sequential reverse sweep over the trajectory it stores)."""
    import osdn_diag.ops.phase1_parallel as parallel

    launched = []
    original = parallel.parallel_fwd
    monkeypatch.setattr(parallel, "parallel_fwd", lambda *a, **o: launched.append("parallel_fwd") or original(*a, **o))
    B, T, H, K, ret, d0, cu, opts = BACKWARD_CASES[case]
    N = B if cu is None else len(cu) - 1
    pinned = d0 is not None and d0.endswith("-pinned")
    k, beta, kw = _inputs(sum(map(ord, case)), B, T, H, K, retention=ret,
                          d0=None if d0 is None else d0.removesuffix("-pinned"), N=N, pinned=pinned)
    if cu is not None:
        opts = {**opts, "cu_seqlens": torch.tensor(cu)}
    gen = torch.Generator().manual_seed(1)
    weights = {
        "write_key": torch.randn(B, T, H, K, generator=gen, dtype=F64),
        "d": torch.randn(B, T, H, K, generator=gen, dtype=F64),
        "d_final": torch.randn(N, H, K, generator=gen, dtype=F64),
    }
    inputs = {"k": k, "beta": beta, **kw}
    ref = _run_grads(osdn_phase1, inputs, opts, weights, cast=lambda x: x)
    dev_opts = {n: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for n, v in opts.items()}
    got = _run_grads(
        lambda *a, **o: ops_phase1.osdn_precondition(*a, **o, return_trajectory=True, method=method),
        inputs, dev_opts, {n: w.to(DEVICE) for n, w in weights.items()},
        cast=lambda x: x.to(DEVICE, torch.float32),
    )
    for name, r in ref.items():
        g = got[name]
        if r is None:  # β does not enter the reference without beta_aware
            assert g is not None and not g.abs().any(), name
            continue
        assert g.dtype == torch.float32, name
        _assert_close(g, r, f"grad {name}", 1e-4)
    assert launched == ([] if method == "sequential" else [f"{method}_fwd"])


def test_backward_write_key_only_bf16():
    """The training path: only ∂L/∂k̃ flows back (no trajectory, no d_final), bf16 inputs."""
    k, beta, kw = _inputs(21, 2, 10, 2, 12, retention="head", d0="shared")
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(*k.shape, generator=gen, dtype=F64).to(torch.bfloat16)
    bf = {n: x.to(torch.bfloat16) for n, x in {"k": k, "beta": beta, **kw}.items()}
    leaves = {n: x.double().requires_grad_(True) for n, x in bf.items()}
    ref_out = osdn_phase1(leaves["k"], leaves["beta"], retention=leaves["retention"], d0=leaves["d0"], eta=1.0)
    ref = torch.autograd.grad((ref_out.write_key * w.double()).sum(), list(leaves.values()))
    dl = {n: x.to(DEVICE).requires_grad_(True) for n, x in bf.items()}
    out = ops_phase1.osdn_precondition(dl["k"], dl["beta"], retention=dl["retention"], d0=dl["d0"], eta=1.0)
    got = torch.autograd.grad((out * w.to(DEVICE)).sum(), list(dl.values()))
    for name, g, r in zip(dl, got, ref):
        assert g.dtype == torch.bfloat16, name
        _assert_close(g, r, f"grad {name}", 1e-2)


def test_gradcheck_fp64_kernel_path():
    """torch.autograd.gradcheck on the kernels themselves (fp64 end to end, tiny, fast mode)."""
    k, beta, kw = _inputs(4, 1, 4, 1, 4, retention="channel", d0="shared")
    k[:, 0, 0] = torch.tensor([0.1, -0.7, 0.5, 0.3], dtype=F64)  # no zero key: keep off the ε kink
    args = tuple(x.to(DEVICE).requires_grad_(True) for x in (k, beta, kw["retention"], kw["d0"]))

    def fn(k, beta, r, d0):
        res = ops_phase1.osdn_precondition(k, beta, retention=r, d0=d0, eta=0.7, return_trajectory=True)
        return res.write_key, res.d, res.d_final

    assert torch.autograd.gradcheck(fn, args, fast_mode=True)


# --- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,pattern",
    [
        (lambda a: {**a, "k": a["k"].new_zeros(1, 2, 1, 300)}, "argument 'k'"),
        (lambda a: {**a, "beta": a["beta"][:, :, :, None]}, "argument 'beta'"),
        (lambda a: {**a, "retention": a["beta"] + 2}, "argument 'retention'"),
        (lambda a: {**a, "d0": a["k"].new_full((1, 8), 3.0)}, "argument 'd0'"),
        (lambda a: {**a, "cu_seqlens": torch.tensor([0, 3, 2])}, "argument 'cu_seqlens'"),
        (lambda a: {**a, "eta": -1.0}, "argument 'eta'"),
        (lambda a: {**a, "method": "magic"}, "argument 'method'"),
        (lambda a: {**a, "k": a["k"].double(), "method": "parallel"}, "argument 'method'.*fp64"),
    ],
)
def test_arguments_are_validated(change, pattern):
    base = {"k": torch.ones(1, 2, 1, 8), "beta": torch.ones(1, 2, 1)}
    a = change(base)
    if a["k"].shape[-1] == 300:
        a["beta"] = torch.ones(1, 2, 1)
    if a["k"].dtype == F64:
        a["beta"] = a["beta"].double()
    k, beta = a.pop("k"), a.pop("beta")
    with pytest.raises(ValueError, match=pattern):
        ops_phase1.osdn_precondition(k.to(DEVICE), beta.to(DEVICE), **{
            n: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for n, v in a.items()})
