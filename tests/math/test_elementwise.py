"""The torch normalisation and SwiGLU forwards (the CPU stand-ins for fla's ``layer_norm_fwd`` and
``swiglu_fwd``) against fp64 formulas written here, against fla's own Triton kernels under the
interpreter, and their use by capture."""

from __future__ import annotations

import math

import pytest
import torch

from osdn_diag.math.elementwise import layer_norm_fwd_reference, swiglu_fwd_reference


def _norm64(x, w, b, res, eps, rms, G):
    """fp64, one row at a time: h = x + res; RMS: h / √(Σh²/D + eps); LN: (h − μ) / √(Σ(h − μ)²/D + eps);
    then · w + b with row t using group t mod G's slice."""
    T, D = x.shape
    y = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        h = [float(x[t, d]) + (float(res[t, d]) if res is not None else 0.0) for d in range(D)]
        mu = 0.0 if rms else sum(h) / D
        c = [v - mu for v in h]
        r = 1.0 / math.sqrt(sum(v * v for v in c) / D + eps)
        g = t % G
        for d in range(D):
            v = c[d] * r
            if w is not None:
                v *= float(w[g * D + d])
            if b is not None:
                v += float(b[g * D + d])
            y[t, d] = v
    return y


CASES = [
    # (T, D, rms, weight, bias, residual, groups)
    (7, 16, True, True, False, False, 1),
    (9, 12, True, True, False, True, 1),     # the fused residual add of fla's prenorm blocks
    (5, 8, False, True, True, True, 1),      # layer norm with bias
    (6, 4, True, False, False, False, 1),    # no affine weight
    (8, 6, False, True, True, False, 2),     # GroupNorm: rows alternate between two groups' weights
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}D{c[1]}-{'rms' if c[2] else 'ln'}-G{c[6]}"
                         + ("-res" if c[5] else ""))
def test_norm_matches_an_fp64_formula(case):
    T, D, rms, has_w, has_b, has_res, G = case
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, D, generator=g) * 3
    x[0] = 0.0  # a zero row: rstd = 1/√eps, y = b
    w = torch.randn(G * D, generator=g) if has_w else None
    b = torch.randn(G * D, generator=g) if has_b else None
    res = torch.randn(T, D, generator=g) if has_res else None
    if has_res:
        res[0] = 0.0
    y, mean, rstd, res_out = layer_norm_fwd_reference(x, w, b, 1e-6, res, is_rms_norm=rms, num_groups=G)
    want = _norm64(x, w, b, res, 1e-6, rms, G)
    assert y.dtype == x.dtype and torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    assert rstd.dtype == torch.float32 and rstd.shape == (T,)
    assert rstd[0].item() == pytest.approx(1 / math.sqrt(1e-6), rel=1e-6)
    assert (mean is None) is rms
    if has_res:
        torch.testing.assert_close(res_out, x + res, rtol=0, atol=0)
    else:
        assert res_out is x  # fla returns x itself where it stores no residual


def test_norm_in_bf16_with_an_fp32_residual_stream():
    """bf16 activations and the residual kept in fp32 (fla's ``residual_in_fp32``): the sum is formed in
    fp32 and kept so; y is rounded to bf16 once, from the fp32 result."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(10, 32, generator=g).bfloat16()
    w = torch.randn(32, generator=g).bfloat16()
    y, _, rstd, res_out = layer_norm_fwd_reference(x, w, None, 1e-5, None, residual_dtype=torch.float32,
                                                   is_rms_norm=True)
    assert y.dtype == torch.bfloat16 and res_out.dtype == torch.float32
    assert torch.equal(res_out, x.float())
    want = _norm64(x.float(), w.float(), None, None, 1e-5, True, 1)
    torch.testing.assert_close(y.double(), want, rtol=8e-3, atol=1e-2)  # one bf16 rounding of the result


def test_swiglu_matches_an_fp64_formula_in_each_dtype():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 5, 24, generator=g) * 4
    y = torch.randn(4, 5, 24, generator=g)
    x[0, 0] = 0.0
    want = x.double() * torch.sigmoid(x.double()) * y.double()
    z = swiglu_fwd_reference(x, y)
    assert z.dtype == torch.float32 and z.shape == x.shape and z.is_contiguous()
    torch.testing.assert_close(z.double(), want, rtol=1e-6, atol=1e-6)
    zb = swiglu_fwd_reference(x.bfloat16(), y.bfloat16())
    assert zb.dtype == torch.bfloat16
    xb, yb = x.bfloat16().double(), y.bfloat16().double()
    torch.testing.assert_close(zb.double(), xb * torch.sigmoid(xb) * yb, rtol=8e-3, atol=1e-2)
    with pytest.raises(ValueError, match="differ in shape"):
        swiglu_fwd_reference(x, y[..., :3])


def test_match_fla_triton_kernels_in_fp32():
    """fla's own kernels (interpreted here) and the stand-ins agree to fp32 rounding: y, mean, rstd and
    the stored residual; the SwiGLU product."""
    from osdn_diag.runtime import prepare

    prepare("cpu")
    from fla.modules.activations.ops import swiglu_fwd
    from fla.modules.norm.layernorm import layer_norm_fwd

    g = torch.Generator().manual_seed(8)
    x = torch.randn(37, 48, generator=g)
    w, b = torch.randn(48, generator=g), torch.randn(48, generator=g)
    res = torch.randn(37, 48, generator=g)
    for rms in (True, False):
        for residual in (None, res):
            got = layer_norm_fwd(x=x, weight=w, bias=None if rms else b, eps=1e-6, residual=residual,
                                 is_rms_norm=rms)
            ours = layer_norm_fwd_reference(x, w, None if rms else b, 1e-6, residual, is_rms_norm=rms)
            for a, c in zip(ours, got):
                if a is None or c is None:
                    assert a is None and c is None
                else:
                    torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    u, v = torch.randn(3, 7, 64, generator=g), torch.randn(3, 7, 64, generator=g)
    torch.testing.assert_close(swiglu_fwd_reference(u, v), swiglu_fwd(u, v), rtol=1e-6, atol=1e-6)


def test_capture_uses_the_stand_ins_on_the_cpu_only_in_reference_mode_and_restores_them(monkeypatch):
    """A DeltaNet with fla's fused norms and SwiGLU: under capture (reference kernels) its norms and MLP
    run the stand-ins, its logits equal the model's own interpreted forward to fp32 rounding, and fla's
    functions are back after the capture; with ``kernels="fla"`` nothing is replaced."""
    from osdn_diag.runtime import prepare

    prepare("cpu")
    import osdn_diag
    import osdn_diag.math.elementwise as ew
    from fla.models import DeltaNetConfig, DeltaNetForCausalLM
    from fla.modules.activations import ops as act
    from fla.modules.norm import layernorm as ln

    torch.manual_seed(0)
    model = DeltaNetForCausalLM(DeltaNetConfig(hidden_size=32, num_hidden_layers=2, num_heads=2, vocab_size=50,
                                               fuse_norm=True, fuse_swiglu=True, use_short_conv=False,
                                               fuse_cross_entropy=False)).eval()
    ids = torch.randint(0, 50, (2, 12))
    norms, swiglus = [], []
    real_norm, real_swiglu = ew.layer_norm_fwd_reference, ew.swiglu_fwd_reference
    monkeypatch.setattr(ew, "layer_norm_fwd_reference", lambda *a, **k: norms.append(1) or real_norm(*a, **k))
    monkeypatch.setattr(ew, "swiglu_fwd_reference", lambda *a, **k: swiglus.append(1) or real_swiglu(*a, **k))
    originals = ln.layer_norm_fwd, act.swiglu_fwd
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits  # fla's kernels, interpreted
        with osdn_diag.capture(model, kernels="reference") as cap:
            assert ln.layer_norm_fwd.__wrapped__ is originals[0] and act.swiglu_fwd.__wrapped__ is originals[1]
            got = model(input_ids=ids, use_cache=False).logits
    assert (ln.layer_norm_fwd, act.swiglu_fwd) == originals
    # per layer: the attention's norm, the MLP's norm, the output gate's norm; the final norm; 2 MLPs
    assert len(norms) >= 2 * 2 + 1 and len(swiglus) == 2
    assert cap.calls
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    norms.clear()
    with osdn_diag.capture(model, kernels="fla"), torch.no_grad():
        assert (ln.layer_norm_fwd, act.swiglu_fwd) == originals
