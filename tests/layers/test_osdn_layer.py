"""The OSDN layer (:class:`osdn_diag.layers.OSDN`) against fla's DeltaNet and an fp64 oracle.

The oracle (``_layer_oracle.osdn_oracle``) rebuilds q/k/v, β, the APF retention and d0 from the layer's
parameters with its own formulas and runs its own token-by-token fp64 recurrence: it shares no code
with the layer or with ``osdn_diag``. All in fp32 under Triton's interpreter (its bf16 dots are wrong),
at tiny shapes: hidden 64, 2 heads (K = V = 32), T ≤ 100.
"""

from __future__ import annotations

import pytest
import torch

from _layer_oracle import osdn_oracle, relative_error

pytestmark = pytest.mark.usefixtures("fla_interpreter")

HIDDEN, HEADS = 64, 2
FP32_REL = 1e-5  # fp32 layer against the fp64 oracle, ‖got − want‖ / ‖want‖


def _layer(**kw):
    from osdn_diag.layers import OSDN

    kw.setdefault("hidden_size", HIDDEN)
    kw.setdefault("num_heads", HEADS)
    return OSDN(**kw)


def _perturb_osdn_params(layer, seed=0):
    """Move APF and d0 away from their flat initialisation so that they matter: the retention varies
    by token between about 0.88 and 0.998 (lower would pin d at d_min, where a wrong retention no
    longer shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if layer.apf:
            layer.r_proj.weight.copy_(0.1 * torch.randn(layer.r_proj.weight.shape, generator=g))
            layer.r_proj.bias.fill_(4.0)
        if layer.learn_d0:
            layer.d0.copy_(1 + 0.3 * torch.rand(layer.d0.shape, generator=g))


def _oracle(layer, x, **kw):
    """The fp64 oracle's output for a layer built by ``_layer(**kw)``, and the d it wrote with."""
    out, d, _ = osdn_oracle(layer, x, **{"num_heads": HEADS, **kw})
    return out, d


def _assert_moved_inside_box(d, d_min, d_max, min_interior=0.5):
    """d left 1 in places, stayed in the box and is mostly not pinned to its faces (so that the
    preconditioner, and APF's retention of it, shape the output)."""
    assert (d - 1).abs().max() > 0.05
    assert d.min() >= d_min - 1e-12 and d.max() <= d_max + 1e-12
    interior = ((d > d_min + 1e-6) & (d < d_max - 1e-6)).double().mean()
    assert interior > min_interior, f"only {interior:.0%} of d's entries inside the box"


@pytest.mark.parametrize(
    "T,kw",
    [
        (70, {}),
        (70, {"use_gate": True}),
        (70, {"allow_neg_eigval": True, "qk_activation": "relu"}),
        (70, {"use_short_conv": False, "qk_norm": "sum", "use_beta": False}),
        (40, {}),
    ],
    ids=["chunk", "chunk_gated_norm", "chunk_negeig_relu", "chunk_noconv_sum_nobeta", "fused_recurrent"],
)
@pytest.mark.filterwarnings("ignore:ShortConvolution is crucial")
def test_eta0_equals_fla_deltanet(fp32_chunk_delta_rule, T, kw):
    """η = 0 and d0 = 1: d ≡ 1, the write key is k, and the layer is DeltaNet with the same weights
    (T = 70 > 64: DeltaNet's chunk path; T = 40: its fused_recurrent path)."""
    from fla.layers import DeltaNet

    torch.manual_seed(0)
    ref = DeltaNet(hidden_size=HIDDEN, num_heads=HEADS, **kw)
    ours = _layer(eta=0.0, **kw)
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not missing and not unexpected
    x = torch.randn(2, T, HIDDEN)
    with torch.no_grad():
        want = ref(x)[0]
        got = ours(x)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("phase1_method", ["sequential", "parallel"])
@pytest.mark.parametrize("apf,learn_d0", [(False, False), (True, True)], ids=["plain", "apf_d0"])
def test_two_phase_forward_equals_fp64_oracle(apf, learn_d0, phase1_method, monkeypatch):
    """Kernels (phase 1, by the forward kernel the layer names, + chunk_osdn; T = 70 is one chunk of
    64 and a partial one) equal the fp64 oracle built from the layer's parameters."""
    import osdn_diag.ops.phase1_parallel as parallel

    launched = []
    original = parallel.parallel_fwd
    monkeypatch.setattr(parallel, "parallel_fwd", lambda *a, **o: launched.append(1) or original(*a, **o))

    torch.manual_seed(1)
    kw = dict(eta=0.5, apf=apf, learn_d0=learn_d0)  # a big η: d moves well away from 1
    layer = _layer(**kw, phase1_method=phase1_method)
    _perturb_osdn_params(layer, seed=1)
    x = torch.randn(2, 70, HIDDEN)
    with torch.no_grad():
        got = layer(x)[0]
        want, d = _oracle(layer, x, **kw)
    _assert_moved_inside_box(d, 0.5, 2.0)  # so this is not DeltaNet's test
    assert relative_error(got, want) <= FP32_REL
    assert bool(launched) is (phase1_method == "parallel")


def _awkward_input(T, zero_at, seed):
    """Hidden states with ``conv_size = 4`` zero rows ending at ``zero_at``: there the projections (and
    convolutions) give exactly 0, so k is a zero row where the activation keeps 0 (silu, relu; elu + 1
    makes it 1) — phase 1 then takes its ‖k‖² floor and the write is empty."""
    x = torch.randn(1, T, HIDDEN, generator=torch.Generator().manual_seed(seed))
    x[:, zero_at - 3:zero_at + 1] = 0.0
    return x


@pytest.mark.parametrize(
    "T,kw,zero_key",
    [
        (100, dict(apf=True, learn_d0=True), True),
        (37, dict(apf=True, use_gate=True, beta_aware=False, qk_activation="elu", qk_norm="sum"), False),
        (37, dict(apf=True, learn_d0=True, use_short_conv=False, qk_activation="relu", conv_bias=True,
                  d_min=0.8, d_max=1.6), True),
    ],
    ids=["chunk_T100", "fused_gate_elu_sum_not_beta_aware", "fused_noconv_relu_box"],
)
@pytest.mark.filterwarnings("ignore:ShortConvolution is crucial")
def test_awkward_inputs_equal_fp64_oracle(T, kw, zero_key, monkeypatch):
    """β pushed to both edges of (0, 1), a zero key row, T = 100 (one chunk and a partial one) on the
    chunked path and T = 37 on the fused recurrent path (inference, T ≤ 64); APF's retention near 1
    with d mostly inside the box. The layer equals the fp64 oracle within fp32 accuracy."""
    import osdn_diag.layers._common as common

    fused_calls = []
    original = common.fused_recurrent_osdn
    monkeypatch.setattr(common, "fused_recurrent_osdn", lambda *a, **o: fused_calls.append(1) or original(*a, **o))

    torch.manual_seed(11)
    kw = dict(eta=0.5, **kw)
    layer = _layer(**kw).eval()
    _perturb_osdn_params(layer, seed=11)
    with torch.no_grad():
        layer.b_proj.weight.mul_(15.0)
    x = _awkward_input(T, zero_at=20, seed=12)
    with torch.no_grad():
        got = layer(x)[0]
        want, d, parts = osdn_oracle(layer, x, num_heads=HEADS, **kw)
    assert bool(fused_calls) is (T <= 64)
    beta = parts["beta"]
    assert beta.min() < 1e-4 and beta.max() > 1 - 1e-4  # both edges reached
    assert bool((parts["k"][:, 20] == 0).all()) is zero_key
    _assert_moved_inside_box(d, kw.get("d_min", 0.5), kw.get("d_max", 2.0), min_interior=0.3)
    assert relative_error(got, want) <= FP32_REL


@pytest.mark.parametrize("use_gate", [False, True], ids=["norm", "gated_norm"])
def test_gradients_reach_every_parameter(use_gate):
    torch.manual_seed(2)
    layer = _layer(eta=0.1, apf=True, learn_d0=True, use_gate=use_gate, conv_bias=True)
    _perturb_osdn_params(layer, seed=2)
    x = torch.randn(1, 40, HIDDEN, requires_grad=True)
    o = layer(x)[0]
    (o * torch.randn_like(o)).sum().backward()
    names = dict(layer.named_parameters())
    assert {"r_proj.weight", "r_proj.bias", "d0"} <= set(names)
    for name, p in names.items():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name
    assert torch.isfinite(x.grad).all() and x.grad.abs().max() > 0


def test_gradients_equal_oracle_autograd():
    """Every parameter's gradient through the kernels equals autograd through the fp64 oracle."""
    torch.manual_seed(7)
    kw = dict(eta=0.3, apf=True, learn_d0=True)
    layer = _layer(**kw)
    _perturb_osdn_params(layer, seed=7)
    x = torch.randn(2, 40, HIDDEN)
    w = torch.randn(2, 40, HIDDEN)
    grads = []
    for fwd in (lambda: layer(x)[0], lambda: _oracle(layer, x, **kw)[0]):
        layer.zero_grad()
        (fwd() * w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}: {m}")


def test_d0_gradient_matches_finite_difference():
    """The learned d0 enters only through phase 1: check its gradient numerically (fp32, coarse)."""
    torch.manual_seed(3)
    layer = _layer(eta=0.1, learn_d0=True)
    _perturb_osdn_params(layer, seed=3)
    x = torch.randn(1, 20, HIDDEN)
    w = torch.randn(1, 20, HIDDEN)
    loss = lambda: (layer(x)[0] * w).sum()  # noqa: E731
    loss().backward()
    g = layer.d0.grad[0, :4].clone()
    h = 1e-2
    fd = []
    for j in range(4):
        with torch.no_grad():
            layer.d0[0, j] += h
            lp = loss()
            layer.d0[0, j] -= 2 * h
            lm = loss()
            layer.d0[0, j] += h
        fd.append((lp - lm) / (2 * h))
    torch.testing.assert_close(g, torch.stack(fd), rtol=5e-2, atol=5e-3)


@pytest.mark.parametrize(
    "kw,name",
    [
        ({"d_min": 0.0}, "d_min"),
        ({"d_min": -0.5}, "d_min"),
        ({"d_min": 2.0, "d_max": 1.0}, "d_max"),
        ({"eta": -0.1}, "eta"),
        ({"eta": float("nan")}, "eta"),
        ({"d_max": float("inf")}, "d_max"),
        ({"phase1_method": "fast"}, "phase1_method"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kw, name):
    with pytest.raises(ValueError, match=f"'{name}'"):
        _layer(**kw)


def test_learn_d0_initialised_inside_box_and_apf_to_high_retention():
    layer = _layer(apf=True, learn_d0=True, d_min=1.5, d_max=3.0)
    assert torch.all(layer.d0 == 1.5)
    layer = _layer(apf=True, learn_d0=True)
    assert torch.all(layer.d0 == 1.0)
    r = layer.r_proj(torch.randn(3, HIDDEN)).sigmoid()
    torch.testing.assert_close(r, torch.full_like(r, 0.999))


def test_cache_continuation_equals_one_pass():
    """Prefill, a chunk, then single-token decode steps through fla's Cache (which carries S, d and the
    conv states) give the one-pass output: d_final really is carried beside S."""
    from fla.models.utils import Cache

    torch.manual_seed(4)
    layer = _layer(eta=0.5, apf=True, learn_d0=True, layer_idx=0)
    _perturb_osdn_params(layer, seed=4)
    x = torch.randn(2, 50, HIDDEN)
    with torch.no_grad():
        want = layer(x)[0]
        cache = Cache()
        parts = []
        for a, b in [(0, 30), (30, 47), (47, 48), (48, 49), (49, 50)]:
            o, _, cache = layer(x[:, a:b], past_key_values=cache, use_cache=True)
            parts.append(o)
        got = torch.cat(parts, 1)
        S, d = cache[0]['recurrent_state']
    assert S.shape == (2, HEADS, 32, 32) and d.shape == (2, HEADS, 32)
    assert (d - 1).abs().max() > 0.05  # the preconditioner in the cache has moved
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_without_cache_carried_d_the_continuation_differs():
    """Control for the test above: restarting d from d0 at the split changes the output."""
    from fla.models.utils import Cache

    torch.manual_seed(5)
    layer = _layer(eta=0.5, layer_idx=0)
    x = torch.randn(1, 50, HIDDEN)
    with torch.no_grad():
        want = layer(x)[0]
        cache = Cache()
        o1, _, cache = layer(x[:, :30], past_key_values=cache, use_cache=True)
        S, d = cache[0]['recurrent_state']
        cache[0]['recurrent_state'] = (S, torch.ones_like(d))
        o2, _, cache = layer(x[:, 30:], past_key_values=cache, use_cache=True)
    assert not torch.allclose(torch.cat([o1, o2], 1), want, rtol=1e-4, atol=1e-5)


def test_padding_mask_equals_separate_sequences():
    """Left padding via attention_mask (packed to cu_seqlens inside): each sequence's phase 1 and
    phase 2 restart at its own start, so the result equals running the sequences one by one."""
    torch.manual_seed(6)
    layer = _layer(eta=0.5, apf=True, learn_d0=True)
    _perturb_osdn_params(layer, seed=6)
    lens = [50, 33]
    T = max(lens)
    x = torch.randn(2, T, HIDDEN)
    mask = torch.zeros(2, T, dtype=torch.long)
    for i, n in enumerate(lens):
        mask[i, T - n:] = 1
    with torch.no_grad():
        got = layer(x, attention_mask=mask)[0]
        for i, n in enumerate(lens):
            want = layer(x[i:i + 1, T - n:])[0]
            torch.testing.assert_close(got[i:i + 1, T - n:], want, rtol=1e-4, atol=1e-5)
