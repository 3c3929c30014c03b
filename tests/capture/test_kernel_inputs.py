"""The two forms of every input transform in osdn_diag.capture.kernel_inputs agree: fla's own function
(what a kernel read, used when fla ran) and the torch emulation (used when the reference recurrence
stands in for fla). Both are checked against formulas written out here in fp64, on awkward inputs
(zero rows, tiny and huge norms, saturated sigmoids), and the emulation against fla bit for bit where
fla stores in bf16. fla runs under Triton's interpreter (elementwise kernels, which it runs right).
"""

from __future__ import annotations

import math

import pytest
import torch

from osdn_diag.capture import kernel_inputs as ki

pytestmark = pytest.mark.usefixtures("fla_interpreter")


def _awkward_rows(n=64, K=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n, 2, K, generator=g)
    x[0, 0] = 0.0                      # zero key: eps keeps it finite (0)
    x[0, 1] *= 1e-4                    # tiny norm, below the eps scale
    x[0, 2] *= 1e3                     # large norm
    x[0, 3, :, 1:] = 0.0               # one-hot
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_l2norm_stored_emulation_is_fla_bit_for_bit_and_both_are_the_formula(dtype):
    x = _awkward_rows().to(dtype)
    fla = ki.l2norm_stored(x, fla=True)
    emu = ki.l2norm_stored(x, fla=False)
    assert fla.dtype == emu.dtype == torch.float32
    assert torch.equal(fla.to(dtype).float(), fla)  # representable in the stored dtype
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}[dtype]
    if dtype != torch.float32:
        # The same bits, up to a rare one-ulp tie decided by a different fp32 summation order.
        same = (fla == emu).float().mean().item()
        assert same >= 0.999, same
    assert (fla - emu).abs().max().item() <= 2 * ulp
    # The formula, in fp64: x / sqrt(Σx² + 1e-6), rounded once to the stored dtype.
    xd = x.double()
    want = xd / torch.sqrt(xd.square().sum(-1, keepdim=True) + 1e-6)
    assert (fla.double() - want).abs().max().item() <= ulp
    assert fla[0, 0].abs().max() == 0 and torch.isfinite(fla).all()


def test_l2norm_in_registers_is_the_fp32_formula():
    x = _awkward_rows().to(torch.bfloat16)
    got = ki.l2norm_in_registers(x)
    xd = x.double()
    want = xd / torch.sqrt(xd.square().sum(-1, keepdim=True) + 1e-6)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= 4e-7
    # Not rounded to bf16: a bf16 model's keys read in registers are unit to fp32 accuracy.
    k2 = got.double().square().sum(-1)[0, 4:]
    assert (k2 - 1).abs().max().item() <= 1e-6


@pytest.mark.parametrize("scale", [1.0, 2.0])
def test_beta_sigmoid_forms_agree(scale):
    b = torch.tensor([[-80.0, -20.0, -1.0, 0.0, 1e-3, 3.0, 20.0, 80.0]]).view(1, 8, 1).to(torch.bfloat16)
    want = scale / (1 + torch.exp(-b.double()))
    for fla in (True, False):
        got = ki.beta_sigmoid(b, scale, fla=fla)
        assert got.dtype == torch.float32
        assert ((got.double() - want).abs() <= 2e-7 * scale).all(), (fla, got, want)


def _softplus(x):
    return torch.where(x < 20, torch.log1p(torch.exp(torch.clamp(x, max=20.0))), x)


def test_gdn_gate_forms_agree_with_the_formula():
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(2, 40, 3, generator=g) * 8).to(torch.bfloat16)  # spans softplus' threshold
    A_log = torch.randn(3, generator=g)
    for dt_bias in (None, torch.randn(3, generator=g)):
        x = a.double() + (0 if dt_bias is None else dt_bias.double())
        want = -A_log.double().exp() * _softplus(x)
        for fla in (True, False):
            got = ki.gdn_gate(a, A_log, dt_bias, fla=fla)
            assert got.shape == a.shape and got.dtype == torch.float32
            assert ((got.double() - want).abs() <= 1e-6 * want.abs().clamp_min(1)).all(), fla


@pytest.mark.parametrize("form", ["softplus", "lower_bound", "lower_bound_no_A"])
def test_kda_gate_forms_agree_with_the_formula(form):
    g = torch.Generator().manual_seed(2)
    HV, K = 2, 16
    a = (torch.randn(1, 24, HV, K, generator=g) * 6).to(torch.bfloat16)
    A_log = None if form == "lower_bound_no_A" else torch.randn(HV, generator=g)
    dt_bias = torch.randn(HV * K, generator=g)
    lower_bound = None if form == "softplus" else -5.0
    x = a.double() + dt_bias.double().view(HV, K)
    if lower_bound is None:
        want = -A_log.double().exp().view(HV, 1) * _softplus(x)
    else:
        z = x if A_log is None else A_log.double().exp().view(HV, 1) * x
        want = lower_bound / (1 + torch.exp(-z))
    for fla in (True, False):
        got = ki.kda_gate(a, A_log, dt_bias, lower_bound, fla=fla)
        assert got.shape == a.shape and got.dtype == torch.float32
        assert ((got.double() - want).abs() <= 2e-6 * want.abs().clamp_min(1)).all(), (form, fla)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_precond_write_key_forms_agree(dtype):
    """chunk_atk_fwd's stored k_precond = d ⊙ k against the emulation from an fp64 accumulator
    (A_t = exp(g_atk) A_{t−1} + β_atk k⊙k, r = log(A + eps) + 0.2, d = 1.5^(−r/(1+|r|)))."""
    g = torch.Generator().manual_seed(3)
    B, T, H, K = 1, 80, 2, 16
    k = ki.l2norm_stored(torch.randn(B, T, H, K, generator=g).to(dtype), fla=False).to(dtype)
    g_atk = -torch.rand(B, T, H, generator=g) * 0.2
    beta_atk = torch.rand(B, T, H, generator=g)
    kw = {"g_atk": g_atk, "beta_atk": beta_atk}
    A = torch.zeros(B, H, K, dtype=torch.float64)
    d = torch.empty(B, T, H, K, dtype=torch.float64)
    for t in range(T):
        A = g_atk[:, t, :, None].double().exp() * A + beta_atk[:, t, :, None].double() * k[:, t].double() ** 2
        r = torch.log(A + 1e-6) + 0.2
        d[:, t] = torch.exp(-math.log(1.5) * r / (1 + r.abs()))
    want = (d * k.double())
    fla = ki.precond_write_key_stored(k, d.float(), kw, fla=True)
    emu = ki.precond_write_key_stored(k, d.float(), kw, fla=False)
    assert torch.equal(fla.to(dtype).float(), fla) and torch.equal(emu.to(dtype).float(), emu)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 1e-6
    # |k̃| ≤ 1.5: one rounding of the stored dtype, relative to the value's binade.
    assert ((fla.double() - want).abs() <= ulp * want.abs().clamp_min(2.0**-6) * 2).all()
    assert ((fla - emu).abs() <= ulp * emu.abs().clamp_min(2.0**-6) * 2).all()
    assert (fla == emu).float().mean().item() >= (0.99 if dtype == torch.bfloat16 else 0.5)


def test_interpreter_rounds_fp32_to_bf16_to_nearest_even_like_torch():
    """The interpreter fix (d) in osdn_diag.runtime.interpret: bf16 stores round like a GPU and like torch."""
    import numpy as np

    from osdn_diag.runtime.interpret import f32_to_bf16_bits

    g = torch.Generator().manual_seed(4)
    x = torch.cat([
        torch.randn(4096, generator=g) * 10.0 ** torch.randint(-30, 30, (4096,), generator=g),
        # exact ties (low half 0x8000), on even and odd bf16 mantissas, and the largest finite values
        torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00008000, 0x00018000],
                     dtype=torch.int64).to(torch.int32).view(torch.float32),
        torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, 3e38]),
    ])
    want = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = f32_to_bf16_bits(x.numpy())
    assert np.array_equal(got, want)
    nan = f32_to_bf16_bits(np.array([float("nan"), -float("nan")], dtype=np.float32))
    assert torch.from_numpy(nan.view(np.int16)).view(torch.bfloat16).float().isnan().all()


def test_unit_roundoff():
    assert ki.unit_roundoff("bfloat16") == 2.0**-8
    assert ki.unit_roundoff("float16") == 2.0**-11
    assert ki.unit_roundoff("tfloat32") == 2.0**-11
    assert ki.unit_roundoff("float32") == 2.0**-24
