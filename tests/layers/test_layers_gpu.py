"""The OSDN layer on a GPU with compiled kernels, bf16, at real head sizes (K = V = 128) and a length
that is not a multiple of the chunk: against fla's DeltaNet (η = 0), against the fp64 reference
(η > 0, forward and gradients), and under capture. Runs only where CUDA is available (the GPU
machine); the same properties are tested on CPU under the interpreter in fp32.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled-kernel tests need a CUDA GPU"),
    pytest.mark.usefixtures("fla_kernels"),
]

B, T, HIDDEN, HEADS = 2, 1000, 512, 4
BF16_TOL = 1e-2


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _osdn(**kw):
    from osdn_diag.layers import OSDN

    torch.manual_seed(0)
    return OSDN(hidden_size=HIDDEN, num_heads=HEADS, **kw).cuda().to(torch.bfloat16)


def _x(requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(B, T, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    return x.requires_grad_(requires_grad)


def test_eta0_equals_fla_deltanet_bf16():
    from fla.layers import DeltaNet

    ours = _osdn(eta=0.0)
    theirs = DeltaNet(hidden_size=HIDDEN, num_heads=HEADS).cuda().to(torch.bfloat16)
    theirs.load_state_dict(ours.state_dict())
    x = _x()
    with torch.no_grad():
        assert _rel(ours(x)[0], theirs(x)[0]) <= BF16_TOL


@pytest.mark.parametrize("apf", [False, True])
def test_forward_and_gradients_match_fp64_reference(apf):
    from osdn_diag.math import osdn, osdn_phase1

    layer = _osdn(eta=0.5, apf=apf)
    x = _x(requires_grad=True)
    o = layer(x)[0]
    w = torch.randn_like(o)
    (gx,) = torch.autograd.grad((o.float() * w.float()).sum(), x)

    # The reference: the layer's own projections (fp32 master copy), both phases in fp64.
    ref_layer = _osdn(eta=0.5, apf=apf).float()
    ref_layer.load_state_dict({n: p.float() for n, p in layer.state_dict().items()})
    xr = x.detach().float().requires_grad_(True)
    q, k, v, beta, r, _ = ref_layer.project(xr)
    dd = lambda t: None if t is None else t.double()  # noqa: E731
    p1 = osdn_phase1(k.double(), beta.double(), retention=dd(r), eta=0.5, d_min=layer.d_min,
                     d_max=layer.d_max, eps=layer.phase1_eps)
    o_ref = osdn(q.double(), k.double(), v.double(), beta.double(), p1.d).o
    o_ref = ref_layer.o_proj(ref_layer.o_norm(o_ref.float()).flatten(-2))
    (gx_ref,) = torch.autograd.grad((o_ref * w.float()).sum(), xr)
    assert torch.isfinite(o).all() and torch.isfinite(gx).all()
    assert _rel(o, o_ref) <= BF16_TOL
    assert _rel(gx, gx_ref) <= 2 * BF16_TOL  # bf16 forward and backward, two roundings deep


def test_capture_records_phase1_d_and_replays_within_bf16_tolerance():
    from osdn_diag.capture.context import capture
    from osdn_diag.replay import replay_call

    layer = _osdn(eta=0.5)
    x = _x()
    with torch.no_grad():
        plain = layer(x)[0]
        with capture(layer, kernels="fla") as cap:
            got = layer(x)[0]
    assert torch.equal(plain, got)
    (call,) = cap.calls
    assert call.flags["d_source"] == "phase1" and call.flags["kernels"] == "fla"
    assert replay_call(call).fidelity <= BF16_TOL
