"""The OSDN layer on a GPU with compiled kernels, bf16, at real head sizes (K = V = 128) and a length
that is not a multiple of the chunk: against fla's DeltaNet (η = 0), against the fp64 oracle of
``_layer_oracle`` (η > 0, forward and gradients; it shares no code with the layer), and under capture.
Runs only where CUDA is available (the GPU machine); the same properties are tested on CPU under the
interpreter in fp32.
"""

from __future__ import annotations

import pytest
import torch

from _layer_oracle import osdn_oracle

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
def test_forward_and_gradients_match_fp64_oracle(apf):
    layer = _osdn(eta=0.5, apf=apf)
    x = _x(requires_grad=True)
    o = layer(x)[0]
    w = torch.randn_like(o)
    (gx,) = torch.autograd.grad((o.float() * w.float()).sum(), x)

    # The oracle: the layer's (bf16) parameters and input in fp64 through its own input side, both
    # phases and output side (tests/layers/_layer_oracle.py); no code shared with the layer.
    xr = x.detach().double().requires_grad_(True)
    o_ref, _, _ = osdn_oracle(layer, xr, num_heads=HEADS, eta=0.5, apf=apf)
    (gx_ref,) = torch.autograd.grad((o_ref * w.double()).sum(), xr)
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
