"""The fused recurrent OSDN / OSGDN kernel (:func:`osdn_diag.ops.osdn_recurrent.fused_recurrent_osdn`)
against the fp64 references: phase 1 (:func:`osdn_diag.math.phase1.osdn_phase1`) then the asymmetric
delta rule (:func:`osdn_diag.math.recurrence.delta_rule_recurrence`).

CPU: Triton's interpreter (the root conftest sets it), fp32 inputs — its bf16 dots are wrong; GPU:
compiled, fp32 and bf16. Shapes include K not a power of two, V spanning several value blocks,
variable lengths, zero keys and β at 0 and 1.
"""

from __future__ import annotations

import pytest
import torch

from osdn_diag.math import osdn_phase1
from osdn_diag.math.recurrence import delta_rule_recurrence
from osdn_diag.ops.osdn_recurrent import fused_recurrent_osdn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
TOL = 1e-5


def _rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "NaN/Inf in the kernel's output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _inputs(seed, B, T, H, K, V, *, gated, ret, d0, h0, N=None, awkward=False):
    gen = torch.Generator().manual_seed(seed)
    N = B if N is None else N
    q = torch.randn(B, T, H, K, generator=gen, dtype=F64)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    if awkward:  # zero keys, β exactly 0 and 1, a spiky key that drives d into the box's edges
        k[:, 3] = 0
        beta[:, 5] = 0
        beta[:, 6] = 1
        k[:, 7:11] = 0
        k[:, 7:11, :, 0] = 1
        beta[:, 7:11] = 0.3
    g = torch.nn.functional.logsigmoid(3 + torch.randn(B, T, H, generator=gen, dtype=F64)) if gated else None
    r = {None: None,
         "head": 0.7 + 0.3 * torch.rand(B, T, H, generator=gen, dtype=F64),
         "channel": 0.7 + 0.3 * torch.rand(B, T, H, K, generator=gen, dtype=F64)}[ret]
    dd0 = {None: None,
           "shared": 0.6 + torch.rand(H, K, generator=gen, dtype=F64),
           "per_seq": 0.6 + torch.rand(N, H, K, generator=gen, dtype=F64)}[d0]
    s0 = 0.3 * torch.randn(N, H, V, K, generator=gen, dtype=F64) if h0 else None
    return dict(q=q, k=k, v=v, beta=beta, g=g, retention=r, d0=dd0, initial_state=s0)


def _reference(ins, *, eta, cu_seqlens=None, beta_aware=True):
    p1 = osdn_phase1(ins["k"], ins["beta"], retention=ins["retention"], d0=ins["d0"], eta=eta,
                     beta_aware=beta_aware, cu_seqlens=cu_seqlens)
    res = delta_rule_recurrence(ins["q"], ins["k"], ins["v"], ins["beta"], write_key=p1.write_key,
                                g=ins["g"], initial_state=ins["initial_state"], cu_seqlens=cu_seqlens)
    return p1, res


def _kernel(ins, dtype=torch.float32, **kw):
    dev = {n: None if x is None else x.to(DEVICE, dtype if n in "qkv" else torch.float32) for n, x in ins.items()}
    with torch.no_grad():
        return fused_recurrent_osdn(**dev, output_final_state=True, return_trajectory=True, **kw)


CASES = [
    # B, T, H, K, V, gated, retention, d0, h0
    (2, 37, 2, 16, 16, False, None, None, False),
    (1, 70, 3, 12, 40, False, "head", "shared", True),     # K not a power of 2; V in two blocks
    (2, 33, 2, 16, 8, True, "channel", "per_seq", True),
    (2, 65, 1, 32, 32, True, None, None, False),
]


@pytest.mark.parametrize("B,T,H,K,V,gated,ret,d0,h0", CASES)
@pytest.mark.parametrize("awkward", [False, True], ids=["plain", "awkward"])
def test_matches_reference(fla_kernels, B, T, H, K, V, gated, ret, d0, h0, awkward):
    ins = _inputs(1, B, T, H, K, V, gated=gated, ret=ret, d0=d0, h0=h0, awkward=awkward)
    eta = 3.0 if awkward else 0.7  # large enough that the spike drives d into the box's edge
    p1, ref = _reference(ins, eta=eta)
    out = _kernel(ins, eta=eta)
    assert _rel(out.o, ref.o) <= TOL
    assert _rel(out.final_state, ref.final_state) <= TOL
    assert _rel(out.d, p1.d) <= TOL and _rel(out.d_final, p1.d_final) <= TOL
    if awkward:  # the spiky key pushed channel 0 against the box
        assert float(p1.d.max()) == 2.0


def test_variable_lengths_restart_state_and_d(fla_kernels):
    cu = torch.tensor([0, 9, 9, 40, 57])  # includes an empty sequence
    ins = _inputs(2, 1, 57, 2, 16, 16, gated=True, ret="head", d0="per_seq", h0=True, N=4)
    p1, ref = _reference(ins, eta=0.5, cu_seqlens=cu)
    out = _kernel(ins, eta=0.5, cu_seqlens=cu.to(DEVICE))
    assert _rel(out.o, ref.o) <= TOL
    assert _rel(out.final_state, ref.final_state) <= TOL
    assert _rel(out.d_final, p1.d_final) <= TOL
    # The empty sequence keeps its initial d and state.
    torch.testing.assert_close(out.d_final[1].cpu().double(), ins["d0"][1], rtol=1e-6, atol=1e-6)


def test_not_beta_aware_and_no_box(fla_kernels):
    ins = _inputs(3, 2, 30, 2, 16, 16, gated=False, ret=None, d0=None, h0=False)
    ins["d0"] = torch.full((2, 16), 3.0, dtype=F64)  # outside [0.5, 2]: allowed only without a box
    p1 = osdn_phase1(ins["k"], ins["beta"], d0=ins["d0"], eta=2.0, beta_aware=False, d_min=None, d_max=None)
    ref = delta_rule_recurrence(ins["q"], ins["k"], ins["v"], ins["beta"], write_key=p1.write_key)
    out = _kernel(ins, eta=2.0, beta_aware=False, d_min=None, d_max=None)
    assert _rel(out.o, ref.o) <= TOL and _rel(out.d, p1.d) <= TOL
    assert float(p1.d.max()) > 2.0  # d lives outside [0.5, 2]: the box really is off


def test_chunked_prefill_continues_through_the_cache(fla_kernels):
    """Two calls carrying (state, d) equal one call: what decoding relies on."""
    ins = _inputs(4, 1, 40, 2, 16, 16, gated=True, ret="head", d0="shared", h0=False)
    whole = _kernel(ins, eta=0.6)
    first = _kernel({n: (x[:, :25] if x is not None and x.dim() >= 3 and n != "d0" else x) for n, x in ins.items()}, eta=0.6)
    rest = {n: (x[:, 25:] if x is not None and x.dim() >= 3 and n != "d0" else x) for n, x in ins.items()}
    rest["d0"], rest["initial_state"] = first.d_final.double().cpu(), first.final_state.double().cpu()
    second = _kernel(rest, eta=0.6)
    torch.testing.assert_close(second.o, whole.o[:, 25:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(second.d_final, whole.d_final, rtol=1e-5, atol=1e-6)


def test_eta0_is_deltanet(fla_kernels):
    ins = _inputs(5, 2, 30, 2, 16, 16, gated=False, ret=None, d0=None, h0=True)
    ref = delta_rule_recurrence(ins["q"], ins["k"], ins["v"], ins["beta"], initial_state=ins["initial_state"])
    out = _kernel(ins, eta=0.0)
    assert _rel(out.o, ref.o) <= TOL
    assert torch.all(out.d == 1)


def test_refuses_gradients_and_bad_arguments(fla_kernels):
    ins = _inputs(6, 1, 8, 1, 8, 8, gated=False, ret=None, d0=None, h0=False)
    dev = {n: None if x is None else x.to(DEVICE, torch.float32) for n, x in ins.items()}
    dev["k"].requires_grad_(True)
    with pytest.raises(RuntimeError, match="no backward"):
        fused_recurrent_osdn(**dev)
    dev["k"] = dev["k"].detach()
    with torch.no_grad():
        with pytest.raises(ValueError, match="d_min"):
            fused_recurrent_osdn(**dev, d_min=0.0)
        with pytest.raises(ValueError, match="eta"):
            fused_recurrent_osdn(**dev, eta=-1.0)
        with pytest.raises(ValueError, match="initial_state"):
            fused_recurrent_osdn(**{**dev, "initial_state": torch.zeros(2, 1, 8, 8, device=DEVICE)})


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter's bf16 arithmetic is not the GPU's")
def test_bf16_inputs_accumulate_in_fp32(fla_kernels):
    ins = _inputs(7, 2, 300, 4, 128, 128, gated=True, ret="head", d0=None, h0=False)
    p1, ref = _reference(ins, eta=0.5)
    out = _kernel(ins, dtype=torch.bfloat16, eta=0.5)
    assert _rel(out.o, ref.o) <= 1e-2 and _rel(out.d, p1.d) <= 1e-2
