"""The torch short convolution (the CPU stand-in for fla's ``causal_conv1d``) against an fp64 loop written
here, against fla's own Triton kernel under the interpreter, and its use by capture."""

from __future__ import annotations

import pytest
import torch

from osdn_diag.math.short_conv import causal_conv1d_reference


def _loop(x, w, bias, residual, act, cu):
    """fp64, one output at a time: y[t, d] = act(Σ_j w[d, j] x[t − W + 1 + j, d] + b[d]) + r[t, d],
    zero before each sequence's first token."""
    x, w = x.double(), w.double()
    B, T, D = x.shape
    W = w.shape[1]
    starts = [0] if cu is None else cu[:-1].tolist()
    ends = [T] if cu is None else cu[1:].tolist()
    y = torch.zeros(B, T, D, dtype=torch.float64)
    for b in range(B):
        for s, e in zip(starts, ends):
            for t in range(s, e):
                for d in range(D):
                    acc = 0.0
                    for j in range(W):
                        src = t - (W - 1) + j
                        if src >= s:
                            acc += float(w[d, j]) * float(x[b, src, d])
                    if bias is not None:
                        acc += float(bias[d])
                    if act:
                        acc = acc / (1.0 + torch.exp(torch.tensor(-acc, dtype=torch.float64)).item())
                    if residual is not None:
                        acc += float(residual[b, t, d])
                    y[b, t, d] = acc
    return y


CASES = [
    # (B, T, D, W, bias, residual, activation, cu_seqlens)
    (2, 9, 5, 4, True, False, "silu", None),
    (1, 11, 3, 4, False, True, None, [0, 2, 3, 11]),   # sequences shorter than the kernel, one of 1 token
    (1, 7, 4, 3, True, True, "swish", [0, 7]),
    (3, 2, 2, 4, False, False, "silu", None),          # T < W
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}D{c[2]}W{c[3]}-{c[6]}-{'varlen' if c[7] else 'dense'}")
def test_matches_an_fp64_loop(case):
    B, T, D, W, has_bias, has_res, act, cu = case
    g = torch.Generator().manual_seed(7)
    x = torch.randn(B, T, D, generator=g)
    x[..., 0, :] = 0.0  # a zero input row
    w = torch.randn(D, W, generator=g)
    bias = torch.randn(D, generator=g) if has_bias else None
    res = torch.randn(B, T, D, generator=g) if has_res else None
    cu_t = None if cu is None else torch.tensor(cu)
    y = causal_conv1d_reference(x, w, bias, res, act, cu_t)
    want = _loop(x, w, bias, res, act, cu_t)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)


def test_bf16_input_returns_bf16_accumulated_in_fp32():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, 4, generator=g).bfloat16()
    w = torch.randn(4, 4, generator=g).bfloat16()
    y = causal_conv1d_reference(x, w, None, None, "silu", None)
    assert y.dtype == torch.bfloat16
    want = _loop(x.float(), w.float(), None, None, True, None)
    assert torch.equal(y, want.float().bfloat16())


def test_refusals():
    x, w = torch.zeros(2, 3, 4), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_reference(x, w, activation="relu")
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_reference(x, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="batch of 1"):
        causal_conv1d_reference(x, w, cu_seqlens=torch.tensor([0, 3]))


def test_matches_fla_triton_kernel_in_fp32():
    """fla's own kernel (under Triton's interpreter here) and the stand-in agree to fp32 rounding."""
    from osdn_diag.runtime import prepare

    prepare("cpu")
    from fla.modules.causal_conv1d.ops import causal_conv1d

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 37, 24, generator=g)
    w = torch.randn(24, 4, generator=g) * 0.5
    bias = torch.randn(24, generator=g)
    res = torch.randn(1, 37, 24, generator=g)
    cu = torch.tensor([0, 5, 6, 37])
    for kwargs in ({}, {"cu_seqlens": cu}):
        got, _ = causal_conv1d(x=x.clone(), weight=w, bias=bias, residual=res, activation="silu", **kwargs)
        ours = causal_conv1d_reference(x, w, bias, res, "silu", kwargs.get("cu_seqlens"))
        torch.testing.assert_close(ours, got, rtol=1e-5, atol=1e-6)


def test_decoding_state_and_steps_match_fla_triton_kernels():
    """The state a prefill leaves and one-token decoding steps, against fla's own kernels (interpreted):
    ``causal_conv1d(..., output_final_state=True)`` and ``causal_conv1d_update`` (in place), for a
    sequence longer and one shorter than the kernel, packed."""
    from osdn_diag.runtime import prepare

    prepare("cpu")
    from fla.modules.causal_conv1d.ops import causal_conv1d, causal_conv1d_update

    from osdn_diag.math.short_conv import causal_conv1d_final_state, causal_conv1d_step_reference

    g = torch.Generator().manual_seed(5)
    D, W = 12, 4
    x = torch.randn(1, 9, D, generator=g)
    w = torch.randn(D, W, generator=g) * 0.5
    bias = torch.randn(D, generator=g)
    cu = torch.tensor([0, 2, 9])  # 2 tokens (< W) and 7
    _, fla_state = causal_conv1d(x=x.clone(), weight=w, bias=bias, activation="silu", output_final_state=True,
                                 cu_seqlens=cu)
    ours_state = causal_conv1d_final_state(x, W, cu)
    assert ours_state.shape == fla_state.shape == (2, D, W)
    torch.testing.assert_close(ours_state, fla_state, rtol=0, atol=0)
    for step in range(3):
        token = torch.randn(2, 1, D, generator=g)
        res = torch.randn(2, 1, D, generator=g)
        want, _ = causal_conv1d_update(x=token.clone(), cache=fla_state, residual=res, weight=w, bias=bias,
                                       activation="silu")
        got = causal_conv1d_step_reference(token, ours_state, w, bias, res, "silu")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours_state, fla_state, rtol=0, atol=0)  # both caches updated in place


def test_capture_uses_the_stand_in_on_the_cpu_only_in_reference_mode_and_restores_it(monkeypatch):
    from osdn_diag.runtime import prepare

    prepare("cpu")
    import osdn_diag
    import osdn_diag.math.short_conv as sc
    from fla.modules.causal_conv1d import ops
    from fla.models import DeltaNetConfig, DeltaNetForCausalLM

    torch.manual_seed(0)
    model = DeltaNetForCausalLM(DeltaNetConfig(hidden_size=32, num_hidden_layers=1, num_heads=2, vocab_size=50,
                                               fuse_cross_entropy=False)).eval()
    ids = torch.randint(0, 50, (1, 12))
    original = ops.causal_conv1d
    seen = []
    real = sc.causal_conv1d_reference
    monkeypatch.setattr(sc, "causal_conv1d_reference", lambda *a, **k: seen.append(1) or real(*a, **k))
    with osdn_diag.capture(model, kernels="reference") as cap:
        assert ops.causal_conv1d is not original and ops.causal_conv1d.__wrapped__ is original
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    assert ops.causal_conv1d is original
    assert len(seen) == 3  # the q, k and v convolutions of the one layer
    assert cap.calls
    with osdn_diag.capture(model, kernels="fla"):
        assert ops.causal_conv1d is original
    # A prefill that leaves its state for decoding runs the stand-in too, and so do the one-token
    # decoding steps (fla's causal_conv1d_update); a call carrying a state into several tokens goes to
    # fla's kernel.
    seen.clear()
    stepped, original_update = [], ops.causal_conv1d_update
    real_step = sc.causal_conv1d_step_reference
    monkeypatch.setattr(sc, "causal_conv1d_step_reference", lambda *a, **k: stepped.append(1) or real_step(*a, **k))
    with osdn_diag.capture(model, kernels="reference"), torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        assert len(seen) == 3
        model(input_ids=ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
        assert len(stepped) == 3
        model(input_ids=ids[:, :2], past_key_values=out.past_key_values, use_cache=True)
        assert len(seen) == 3 and len(stepped) == 3
    assert ops.causal_conv1d_update is original_update


def test_a_sequence_gives_the_same_bits_alone_and_packed_and_nan_stays_in_its_sequence():
    """Packing must not change a token's output (batched runs equal one-by-one runs, tests/pipeline/
    test_run.py), and a NaN in one packed sequence must not reach the next."""
    g = torch.Generator().manual_seed(11)
    lengths = [5, 1, 9, 3]
    x = torch.randn(1, sum(lengths), 16, generator=g)
    w, bias = torch.randn(16, 4, generator=g), torch.randn(16, generator=g)
    cu = torch.tensor([0, 5, 6, 15, 18])
    packed = causal_conv1d_reference(x, w, bias, None, "silu", cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = causal_conv1d_reference(x[:, s:e], w, bias, None, "silu", None)
        assert torch.equal(packed[:, s:e], alone)
    x[0, 4, 3] = float("nan")  # last token of the first sequence
    out = causal_conv1d_reference(x, w, bias, None, "silu", cu)
    assert torch.isnan(out[0, 4, 3]) and torch.isfinite(out[0, 5:]).all()
