"""The OSGDN layer (:class:`osdn_diag.layers.OSGDN`) against fla's GatedDeltaNet and an fp64 oracle.

The oracle (``_layer_oracle.osgdn_oracle``) rebuilds q/k/v, β, the decay, the APF retention and d0
from the layer's parameters with its own formulas and runs its own token-by-token fp64 recurrence: it
shares no code with the layer or with ``osdn_diag``. All in fp32 under Triton's interpreter (its bf16
dots are wrong), at tiny shapes: hidden 32, 2 key heads of K = 16, value heads V = 16 (2 of them, or 4
with grouped value heads), T ≤ 70.
"""

from __future__ import annotations

import math

import pytest
import torch

from _layer_oracle import osgdn_oracle, relative_error

pytestmark = pytest.mark.usefixtures("fla_interpreter")

HIDDEN, HEADS, HEAD_DIM = 32, 2, 16
BASE = dict(hidden_size=HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, expand_v=1.0)
FP32_REL = 1e-5  # fp32 layer against the fp64 oracle, ‖got − want‖ / ‖want‖


def _layer(**kw):
    from osdn_diag.layers import OSGDN

    return OSGDN(**{**BASE, **kw})


def _perturb_osdn_params(layer, seed=0):
    """Move APF and d0 away from their flat initialisation so that they matter: the retention varies
    by token between about 0.9 and 0.998 (lower would pin d at d_min, where a wrong retention no
    longer shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if layer.apf:
            layer.r_proj.weight.copy_(0.1 * torch.randn(layer.r_proj.weight.shape, generator=g))
            layer.r_proj.bias.fill_(4.0)
        if layer.learn_d0:
            layer.d0.copy_(1 + 0.3 * torch.rand(layer.d0.shape, generator=g))


def _left_padding_mask(lens, T):
    mask = torch.zeros(len(lens), T, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, T - n:] = 1
    return mask


def _oracle(layer, x, **kw):
    """The fp64 oracle's output for a layer built by ``_layer(**kw)``, and the d it wrote with."""
    out, d, _ = osgdn_oracle(layer, x, **{"num_heads": HEADS, **kw})
    return out, d


@pytest.mark.parametrize(
    "kw,masked",
    [
        ({}, False),
        ({"num_v_heads": 4, "use_gate": False}, True),
        ({"use_short_conv": False, "allow_neg_eigval": True, "conv_bias": True}, False),
    ],
    ids=["gated", "gva_nogate_padded", "noconv_negeig"],
)
@pytest.mark.filterwarnings("ignore:ShortConvolution is crucial")
def test_eta0_equals_fla_gated_deltanet(kw, masked):
    """η = 0 and d0 = 1: d ≡ 1, the write key is k, and the layer is GatedDeltaNet with the same
    weights — against both of fla's paths (no grad: fused_recurrent; grad enabled: chunk), with
    grouped value heads (value head i reads key head i // 2) and with left padding (varlen)."""
    from fla.layers import GatedDeltaNet

    torch.manual_seed(0)
    ref = GatedDeltaNet(**{**BASE, **kw}).eval()
    ours = _layer(eta=0.0, **kw).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    T = 40
    x = torch.randn(2, T, HIDDEN)
    mask = _left_padding_mask([40, 27], T) if masked else None
    with torch.no_grad():
        got = ours(x, attention_mask=mask)[0]
        want_recurrent = ref(x, attention_mask=mask)[0]
    want_chunk = ref(x, attention_mask=mask)[0].detach()
    if masked:  # padded positions are zero on both sides; compare the real tokens
        keep = mask.bool()
        got, want_recurrent, want_chunk = got[keep], want_recurrent[keep], want_chunk[keep]
    torch.testing.assert_close(got, want_recurrent, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got, want_chunk, rtol=1e-4, atol=1e-5)


def test_forward_and_gradients_equal_fp64_oracle():
    """Kernels (phase 1 + gated chunk_osdn) equal the fp64 oracle built from the layer's parameters,
    forward and every parameter's gradient (grouped value heads, output gate, APF and learned d0; the
    decay's A_log / dt_bias gradients flow through g)."""
    torch.manual_seed(1)
    kw = dict(eta=0.5, apf=True, learn_d0=True, num_v_heads=4)  # a big η: d moves well away from 1
    layer = _layer(**kw)
    _perturb_osdn_params(layer, seed=1)
    x = torch.randn(2, 40, HIDDEN)
    w = torch.randn(2, 40, HIDDEN)

    got = layer(x)[0]
    (got * w).sum().backward()
    got_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    want, d = _oracle(layer, x, **kw)
    (want * w).sum().backward()

    assert relative_error(got, want) <= FP32_REL
    # the preconditioner really moved, stayed in the box without being pinned to it, and differs
    # across the value heads that share a key head (they have their own β and retention)
    assert (d - 1).abs().max() > 0.05
    assert d.min() >= layer.d_min - 1e-12 and d.max() <= layer.d_max + 1e-12
    assert ((d > 0.5 + 1e-6) & (d < 2.0 - 1e-6)).double().mean() > 0.5
    assert (d[:, :, 0] - d[:, :, 1]).abs().max() > 1e-3
    assert {"r_proj.weight", "r_proj.bias", "d0", "A_log", "dt_bias"} <= set(got_grads)
    for n, p in layer.named_parameters():
        assert torch.isfinite(got_grads[n]).all() and got_grads[n].abs().max() > 0, n
        torch.testing.assert_close(got_grads[n], p.grad.float(), rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_v_heads=4, use_gate=False, beta_aware=False, learn_d0=True),
        dict(use_short_conv=False, conv_bias=True, output_gate_activation="sigmoid", d_min=0.8, d_max=1.6),
    ],
    ids=["gva_nogate_not_beta_aware", "noconv_sigmoid_gate_box"],
)
@pytest.mark.filterwarnings("ignore:ShortConvolution is crucial")
def test_awkward_inputs_equal_fp64_oracle(kw):
    """T = 70 (one chunk of 64 and a partial one), β pushed to the edges of (0, 1), a zero key row
    (four zero hidden states: the convolutions and projections give exactly 0 there, and SiLU keeps
    it), APF with d mostly inside the box. The layer equals the fp64 oracle within fp32 accuracy."""
    torch.manual_seed(13)
    kw = dict(eta=0.5, apf=True, **kw)
    layer = _layer(**kw)
    _perturb_osdn_params(layer, seed=13)
    with torch.no_grad():
        layer.b_proj.weight.mul_(10.0)
    x = torch.randn(1, 70, HIDDEN, generator=torch.Generator().manual_seed(14))
    x[:, 17:21] = 0.0
    with torch.no_grad():
        got = layer(x)[0]
        want, d, parts = osgdn_oracle(layer, x, num_heads=HEADS, **kw)
    assert parts["beta"].min() < 1e-4 and parts["beta"].max() > 1 - 1e-4  # both edges reached
    assert (parts["k"][:, 20] == 0).all()
    lo, hi = kw.get("d_min", 0.5), kw.get("d_max", 2.0)
    assert (d - 1).abs().max() > 0.05 and d.min() >= lo - 1e-12 and d.max() <= hi + 1e-12
    assert ((d > lo + 1e-6) & (d < hi - 1e-6)).double().mean() > 0.2
    assert relative_error(got, want) <= FP32_REL


def test_cache_continuation_equals_one_pass():
    """Prefill, a chunk, then single-token decode steps through fla's Cache (S, d and the conv
    states) give the one-pass output."""
    from fla.models.utils import Cache

    torch.manual_seed(4)
    layer = _layer(eta=0.5, apf=True, learn_d0=True, num_v_heads=4, layer_idx=0)
    _perturb_osdn_params(layer, seed=4)
    x = torch.randn(2, 40, HIDDEN)
    with torch.no_grad():
        want = layer(x)[0]
        cache = Cache()
        parts = []
        for a, b in [(0, 25), (25, 38), (38, 39), (39, 40)]:
            o, _, cache = layer(x[:, a:b], past_key_values=cache, use_cache=True)
            parts.append(o)
        got = torch.cat(parts, 1)
        S, d = cache[0]['recurrent_state']
    assert S.shape == (2, 4, HEAD_DIM, HEAD_DIM) and d.shape == (2, 4, HEAD_DIM)  # [N, HV, V, K], [N, HV, K]
    assert (d - 1).abs().max() > 0.05
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_padding_mask_equals_separate_sequences():
    """Left padding via attention_mask (packed to cu_seqlens inside): phase 1, the decay and the state
    restart at each sequence's own start."""
    torch.manual_seed(6)
    layer = _layer(eta=0.5, apf=True)
    _perturb_osdn_params(layer, seed=6)
    lens, T = [40, 23], 40
    x = torch.randn(2, T, HIDDEN)
    with torch.no_grad():
        got = layer(x, attention_mask=_left_padding_mask(lens, T))[0]
        for i, n in enumerate(lens):
            want = layer(x[i:i + 1, T - n:])[0]
            torch.testing.assert_close(got[i:i + 1, T - n:], want, rtol=1e-4, atol=1e-5)


def test_state_dict_is_gated_deltanets_plus_osdn_parameters_and_init():
    from fla.layers import GatedDeltaNet

    torch.manual_seed(0)
    ref_keys = set(GatedDeltaNet(**BASE, num_v_heads=4).state_dict())
    layer = _layer(apf=True, learn_d0=True, num_v_heads=4, d_min=1.5, d_max=3.0)
    assert set(layer.state_dict()) == ref_keys | {"r_proj.weight", "r_proj.bias", "d0"}
    assert layer.r_proj.out_features == 4 and layer.d0.shape == (4, HEAD_DIM)  # per value head
    assert torch.all(layer.d0 == 1.5)  # 1 clamped into the box
    assert torch.all(layer.r_proj.weight == 0)
    torch.testing.assert_close(layer.r_proj.bias.sigmoid(), torch.full((4,), 0.999))
    layer = _layer(d_min=1.5, d_max=3.0)
    assert torch.all(layer.initial_d() == 1.5)


@pytest.mark.parametrize(
    "kw,name",
    [
        ({"d_min": 0.0}, "d_min"),
        ({"d_min": 2.0, "d_max": 1.0}, "d_max"),
        ({"d_max": float("inf")}, "d_max"),
        ({"eta": -0.1}, "eta"),
        ({"eta": float("nan")}, "eta"),
        ({"phase1_eps": 0.0}, "phase1_eps"),
        ({"phase1_method": "blocked"}, "phase1_method"),
        ({"num_v_heads": 3}, "num_v_heads"),
        ({"num_v_heads": 1}, "num_v_heads"),
        ({"mode": "fused_chunk"}, "mode"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kw, name):
    with pytest.raises(ValueError, match=f"'{name}'"):
        _layer(**kw)


def test_apf_init_retention_is_high():
    layer = _layer(apf=True)
    r = layer.r_proj(torch.randn(3, HIDDEN)).sigmoid()
    torch.testing.assert_close(r, torch.full_like(r, 0.999))
    assert math.isclose(layer.r_proj.bias[0].item(), math.log(999), rel_tol=1e-6)
