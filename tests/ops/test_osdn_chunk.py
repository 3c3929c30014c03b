"""OSDN phase 2 (:func:`osdn_diag.ops.osdn_chunk.chunk_osdn`, fla 0.6.0's chunk building blocks with our
write key) against the fp64 reference :func:`osdn_diag.math.recurrence.delta_rule_recurrence` and
torch.autograd through it.

CPU: fla's kernels under Triton's interpreter (the root conftest sets ``TRITON_INTERPRET=1`` on machines
without CUDA; its ``fla_kernels`` fixture prepares fla), compiled kernels on a GPU. fp32 only: the
interpreter's bf16 dots are wrong. Shapes are tiny.

Tolerances: fp32 accuracy (1e-5 forward, 1e-4 gradients) under the interpreter; on a GPU fla's chunk
blocks take fp32 dot products in tf32 (measured on an H200: 1.7e-3 forward here, the same 1e-3 level
as fla's own ``chunk_gated_delta_rule``), so there the tf32 tolerance of the replay engine applies.
"""

from __future__ import annotations

import pytest
import torch

from osdn_diag.math.recurrence import delta_rule_recurrence

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
ON_GPU = DEVICE == "cuda"
# fla's chunk kernels on a GPU use tf32 dots: the documented 1e-2 (docs/design-notes.md, note 3).
FWD_TOL = 1e-2 if ON_GPU else 1e-5
BWD_TOL = 1e-2 if ON_GPU else 1e-4


def _inputs(seed, B, T, H, K, V, *, gated, h0, N=None):
    """fp64 CPU inputs: unit read keys, write keys ``d ⊙ k`` with ``d ∈ [0.5, 2]``, β ∈ (0, 1), log
    decays near 0 (α ∈ ~[0.7, 1])."""
    gen = torch.Generator().manual_seed(seed)
    N = B if N is None else N
    q = torch.randn(B, T, H, K, generator=gen, dtype=F64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    d = 0.5 + 1.5 * torch.rand(B, T, H, K, generator=gen, dtype=F64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    g = None
    if gated:
        g = torch.nn.functional.logsigmoid(3.0 + torch.randn(B, T, H, generator=gen, dtype=F64))
    s0 = 0.3 * torch.randn(N, H, V, K, generator=gen, dtype=F64) if h0 else None
    return dict(q=q, k=k, v=v, beta=beta, write_key=d * k, g=g, initial_state=s0)


def _rel(got, ref):
    return ((got.detach().double().cpu() - ref.detach()).norm() / ref.detach().norm().clamp_min(1e-300)).item()


def _run_kernel(ins, cu_seqlens, *, output_final_state=True, grad=False):
    from osdn_diag.ops.osdn_chunk import chunk_osdn

    x = {
        n: None if a is None else a.to(DEVICE, torch.float32).requires_grad_(grad)
        for n, a in ins.items()
    }
    cu = None if cu_seqlens is None else cu_seqlens.to(DEVICE)
    o, ht = chunk_osdn(
        x["q"], x["k"], x["v"], x["beta"], x["write_key"], g=x["g"],
        initial_state=x["initial_state"], output_final_state=output_final_state, cu_seqlens=cu,
    )
    return x, o, ht


def _run_ref(ins, cu_seqlens, grad=False):
    r = {n: None if a is None else a.clone().requires_grad_(grad) for n, a in ins.items()}
    res = delta_rule_recurrence(
        r["q"], r["k"], r["v"], r["beta"], write_key=r["write_key"], g=r["g"],
        initial_state=r["initial_state"], cu_seqlens=cu_seqlens,
    )
    return r, res


def _backward_or_skip(loss):
    try:
        loss.backward()
    except RuntimeError as e:  # fla's Hopper guard on the gated chunk_bwd_dqkwg (fla #640)
        if "#640" in str(e):
            pytest.skip(f"fla refuses the gated chunk backward here: {e}")
        raise


CASES = [
    # (B, T, H, K, V, cu_seqlens, h0)
    pytest.param(1, 100, 2, 16, 32, None, False, id="T100-noh0"),
    pytest.param(2, 70, 2, 32, 16, None, True, id="B2-T70-h0"),
    pytest.param(1, 100, 2, 16, 16, torch.tensor([0, 37, 100]), True, id="varlen-h0"),
    pytest.param(1, 90, 2, 32, 32, torch.tensor([0, 64, 65, 90]), False, id="varlen-len1-noh0"),
]


@pytest.mark.parametrize("gated", [False, True], ids=["osdn", "osgdn"])
@pytest.mark.parametrize("B,T,H,K,V,cu_seqlens,h0", CASES)
def test_forward_matches_reference(fla_kernels, B, T, H, K, V, cu_seqlens, h0, gated):
    N = None if cu_seqlens is None else len(cu_seqlens) - 1
    ins = _inputs(1, B, T, H, K, V, gated=gated, h0=h0, N=N)
    with torch.no_grad():
        _, o, ht = _run_kernel(ins, cu_seqlens)
    _, ref = _run_ref(ins, cu_seqlens)
    assert o.shape == ref.o.shape and ht.shape == ref.final_state.shape
    assert ht.dtype == torch.float32
    assert _rel(o, ref.o) <= FWD_TOL
    assert _rel(ht, ref.final_state) <= FWD_TOL


@pytest.mark.parametrize("gated", [False, True], ids=["osdn", "osgdn"])
@pytest.mark.parametrize("B,T,H,K,V,cu_seqlens,h0", CASES)
def test_backward_matches_autograd_reference(fla_kernels, B, T, H, K, V, cu_seqlens, h0, gated):
    N = None if cu_seqlens is None else len(cu_seqlens) - 1
    ins = _inputs(2, B, T, H, K, V, gated=gated, h0=h0, N=N)
    x, o, ht = _run_kernel(ins, cu_seqlens, grad=True)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(o.shape, generator=gen, dtype=F64)
    dht = torch.randn(ht.shape, generator=gen, dtype=F64)
    _backward_or_skip((o * do.to(o)).sum() + (ht * dht.to(ht)).sum())
    r, ref = _run_ref(ins, cu_seqlens, grad=True)
    ((ref.o * do).sum() + (ref.final_state * dht).sum()).backward()
    for name, a in x.items():
        if a is None:
            continue
        assert a.grad is not None, name
        err = _rel(a.grad, r[name].grad)
        assert err <= BWD_TOL, f"d{name}: relative error {err:.3g}"


@pytest.mark.parametrize("gated", [False, True], ids=["osdn", "osgdn"])
def test_backward_without_final_state(fla_kernels, gated):
    """``output_final_state=False``: no ``dht`` reaches the kernel (fla's ``dht=None`` path)."""
    ins = _inputs(4, 1, 80, 2, 16, 16, gated=gated, h0=True)
    x, o, ht = _run_kernel(ins, None, output_final_state=False, grad=True)
    assert ht is None
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    _backward_or_skip((o * do.to(o)).sum())
    r, ref = _run_ref(ins, None, grad=True)
    (ref.o * do).sum().backward()
    for name, a in x.items():
        if a is not None:
            err = _rel(a.grad, r[name].grad)
            assert err <= BWD_TOL, f"d{name}: relative error {err:.3g}"


@pytest.mark.parametrize("gated", [False, True], ids=["osdn", "osgdn"])
def test_swapped_keys_give_a_different_answer(fla_kernels, gated):
    """Read and write keys are not interchangeable: passing them the other way round is OSDN with the
    roles swapped, a different recurrence — the kernel must follow the reference's assignment."""
    ins = _inputs(6, 1, 100, 2, 16, 16, gated=gated, h0=True)
    swapped = dict(ins, k=ins["write_key"], write_key=ins["k"])
    with torch.no_grad():
        _, o_sw, ht_sw = _run_kernel(swapped, None)
    _, ref = _run_ref(ins, None)
    _, ref_sw = _run_ref(swapped, None)
    # The kernel with swapped keys follows the swapped reference, and that is far from the right one.
    assert _rel(o_sw, ref_sw.o) <= FWD_TOL
    assert _rel(o_sw, ref.o) > 1e-2
    assert _rel(ht_sw, ref.final_state) > 1e-2


def test_symmetric_keys_equal_deltanet(fla_kernels):
    """With ``write_key = k`` the asymmetric path is plain DeltaNet: it matches the reference without a
    write key (guards against a block that silently ignores one of the two keys)."""
    ins = _inputs(7, 1, 70, 2, 16, 16, gated=False, h0=True)
    ins["write_key"] = ins["k"].clone()
    with torch.no_grad():
        _, o, ht = _run_kernel(ins, None)
    res = delta_rule_recurrence(ins["q"], ins["k"], ins["v"], ins["beta"], initial_state=ins["initial_state"])
    assert _rel(o, res.o) <= FWD_TOL
    assert _rel(ht, res.final_state) <= FWD_TOL


def test_phase1_then_phase2_end_to_end(fla_kernels):
    """Phase 1 (Triton) feeding phase 2 (fla blocks): output and gradients to ``k`` (through both the
    read key and the write key ``d ⊙ k``) and ``β`` match the fp64 references chained the same way."""
    ops_phase1 = pytest.importorskip("osdn_diag.ops.phase1", reason="needs triton")
    from osdn_diag.math.phase1 import osdn_phase1
    from osdn_diag.ops.osdn_chunk import chunk_osdn

    ins = _inputs(8, 1, 90, 2, 16, 16, gated=False, h0=False)
    q, k, v, beta = (ins[n] for n in ("q", "k", "v", "beta"))
    kf = k.float().to(DEVICE).requires_grad_()
    bf = beta.float().to(DEVICE).requires_grad_()
    wk = ops_phase1.osdn_precondition(kf, bf, eta=0.3)
    o, _ = chunk_osdn(q.float().to(DEVICE), kf, v.float().to(DEVICE), bf, wk)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    (o * do.to(o)).sum().backward()

    kr, br = k.clone().requires_grad_(), beta.clone().requires_grad_()
    wk_ref = osdn_phase1(kr, br, eta=0.3).write_key
    ref = delta_rule_recurrence(q, kr, v, br, write_key=wk_ref)
    (ref.o * do).sum().backward()
    assert _rel(o, ref.o) <= FWD_TOL
    assert _rel(kf.grad, kr.grad) <= BWD_TOL
    assert _rel(bf.grad, br.grad) <= BWD_TOL
