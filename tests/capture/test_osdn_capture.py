"""Capture of the package's own OSDN layer: the record holds phase 1's exact ``d`` and replays the
phase-2 kernel's output; capture changes nothing the layer computes.

fp32 under Triton's interpreter, tiny shapes (hidden 64, 2 heads, K = V = 32).
"""

from __future__ import annotations

import pytest
import torch

from osdn_diag.capture.context import capture
from osdn_diag.math import osdn_phase1
from osdn_diag.replay import replay_call

pytestmark = pytest.mark.usefixtures("fla_interpreter")


def _layer(seed=0, **kw):
    from osdn_diag.layers import OSDN

    torch.manual_seed(seed)
    layer = OSDN(hidden_size=64, num_heads=2, eta=kw.pop("eta", 0.8), **kw)
    if layer.apf:
        with torch.no_grad():
            layer.r_proj.weight.normal_(0, 0.05)
            layer.r_proj.bias.fill_(1.5)  # r ≈ 0.82: retention visibly matters
    return layer


def _x(B, T, seed=1):
    return torch.randn(B, T, 64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kernels", ["fla", "reference"])
@pytest.mark.parametrize("apf", [False, True])
def test_record_holds_phase1_d_and_replays(kernels, apf):
    layer = _layer(apf=apf)
    x = _x(2, 45)
    with torch.no_grad():
        plain = layer(x)[0]
        with capture(layer, kernels=kernels) as cap:
            got = layer(x)[0]
    # Capture (fla kernels) returns exactly what the layer computes without it; the reference
    # stand-in agrees to fp32 accuracy.
    if kernels == "fla":
        assert torch.equal(got, plain)
    else:
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)

    (call,) = cap.calls
    assert call.family == "osdn" and call.kernel == "chunk_osdn"
    assert call.flags["d_source"] == "phase1" and call.flags["kernels"] == kernels
    # d is the reference phase-1 trajectory over the keys and β the record itself holds.
    with torch.no_grad():
        q, k, v, beta, r, _ = layer.project(x)
    ref = osdn_phase1(call.k.double(), call.beta.double(), retention=None if r is None else r.double(),
                      eta=layer.eta, d_min=layer.d_min, d_max=layer.d_max, eps=layer.phase1_eps)
    torch.testing.assert_close(call.d.double(), ref.d, rtol=1e-5, atol=1e-6)
    assert (call.d - 1).abs().max() > 0.05, "eta > 0 should move d away from 1"
    assert replay_call(call).fidelity <= 1e-5


def test_padded_batch_records_packed_sequences():
    layer = _layer()
    x = _x(2, 30)
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :12] = 0  # left padding: the second sequence has 18 tokens
    with torch.no_grad(), capture(layer, kernels="fla") as cap:
        layer(x, attention_mask=mask)
    (call,) = cap.calls
    assert call.cu_seqlens.tolist() == [0, 30, 48]
    # d restarts at every sequence boundary, as phase 1 does.
    torch.testing.assert_close(call.d[0, 30], torch.ones_like(call.d[0, 30]))
    assert replay_call(call).fidelity <= 1e-5


def test_prefill_then_decode_records_carry_d():
    from fla.models.utils import Cache

    layer = _layer(layer_idx=0)
    x = _x(1, 24)
    cache = Cache()
    with torch.no_grad(), capture(layer, kernels="fla") as cap:
        layer(x[:, :20], past_key_values=cache, use_cache=True)
        layer(x[:, 20:], past_key_values=cache, use_cache=True)
    first, second = cap.calls
    # The second call starts from the preconditioner the first ended with, and from its state.
    assert not torch.allclose(second.d[0, 0], torch.ones_like(second.d[0, 0]))
    assert second.initial_state is not None
    for call in (first, second):
        assert replay_call(call).fidelity <= 1e-5


def test_chunk_osdn_alone_recovers_d_from_the_write_key():
    from osdn_diag.capture.adapters import OSDNAdapter

    g = torch.Generator().manual_seed(3)
    k = torch.nn.functional.normalize(torch.randn(1, 9, 2, 8, generator=g), dim=-1)
    k[0, 4, 1] = 0  # a zero key: d defaults to 1 there
    d = 0.5 + 1.5 * torch.rand(1, 9, 2, 8, generator=g)
    kw = {"q": k, "k": k, "v": torch.randn(1, 9, 2, 8, generator=g), "beta": torch.rand(1, 9, 2, generator=g),
          "write_key": d * k}
    adapter = OSDNAdapter()
    c = adapter.canonical(kw)
    assert adapter.flags(kw) == {"d_source": "write_key/k"}
    torch.testing.assert_close(c.d[0, 4, 1], torch.ones(8))
    mask = k != 0
    torch.testing.assert_close(c.d[mask], d[mask])


@pytest.mark.parametrize("kernels", ["fla", "reference"])
def test_osgdn_record_holds_gate_and_phase1_d_per_value_head(kernels):
    from osdn_diag.layers import OSGDN

    torch.manual_seed(0)
    # Grouped value heads: 4 value heads read 2 key heads; phase 1 runs per value head.
    layer = OSGDN(hidden_size=32, num_heads=2, num_v_heads=4, head_dim=16, expand_v=1.0, eta=0.8)
    x = torch.randn(2, 45, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = layer(x)[0]
        with capture(layer, kernels=kernels) as cap:
            got = layer(x)[0]
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)
    (call,) = cap.calls
    assert call.family == "osgdn" and call.gated and call.num_heads == 4
    assert call.flags["d_source"] == "phase1"
    with torch.no_grad():
        q, k, v, beta, g, r, _ = layer.project(x)
    torch.testing.assert_close(call.g, g.float())
    ref = osdn_phase1(call.k.double(), call.beta.double(), eta=layer.eta, d_min=layer.d_min,
                      d_max=layer.d_max, eps=layer.phase1_eps)
    torch.testing.assert_close(call.d.double(), ref.d, rtol=1e-5, atol=1e-6)
    assert replay_call(call).fidelity <= 1e-5


@pytest.mark.parametrize("kernels", ["fla", "reference"])
@pytest.mark.parametrize("gated", [False, True], ids=["osdn", "osgdn"])
def test_fused_recurrent_path_records_its_own_d(kernels, gated):
    """Short inputs at inference take the fused kernel: same output as the chunked path, and the
    record holds the d the fused kernel wrote with."""
    from osdn_diag.layers import OSGDN

    if gated:
        torch.manual_seed(0)
        layer = OSGDN(hidden_size=32, num_heads=2, head_dim=16, expand_v=1.0, eta=0.8, apf=True)
    else:
        layer = _layer(apf=True)
    x = _x(2, 30)[..., : layer.hidden_size]
    with torch.no_grad():
        chunked = layer.train()(x)[0]  # training mode: always the chunked phases
        layer.eval()
        with capture(layer, kernels=kernels) as cap:
            fused = layer(x)[0]
    torch.testing.assert_close(fused, chunked, rtol=1e-5, atol=1e-5)
    (call,) = cap.calls
    assert call.kernel == "fused_recurrent_osdn" and call.flags["d_source"] == "fused kernel"
    assert call.family == ("osgdn" if gated else "osdn") and call.gated == gated
    with torch.no_grad():
        proj = layer.project(x)
    k, beta, r = proj[1], proj[3], proj[-2]
    ref = osdn_phase1(k.double(), beta.double(), retention=r.double(), eta=layer.eta,
                      d_min=layer.d_min, d_max=layer.d_max, eps=layer.phase1_eps)
    torch.testing.assert_close(call.d.double(), ref.d, rtol=1e-5, atol=1e-6)
    assert replay_call(call).fidelity <= 1e-5


def test_decode_through_the_fused_path_equals_one_pass():
    from fla.models.utils import Cache

    layer = _layer(layer_idx=0, apf=True).eval()
    x = _x(1, 100)
    with torch.no_grad():
        whole = layer(x)[0]  # 100 tokens: the chunked path
        cache = Cache()
        parts = [layer(x[:, :90], past_key_values=cache, use_cache=True)[0]]  # chunked prefill
        for t in range(90, 100):  # then one token at a time: the fused kernel
            parts.append(layer(x[:, t : t + 1], past_key_values=cache, use_cache=True)[0])
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-5, atol=1e-5)
