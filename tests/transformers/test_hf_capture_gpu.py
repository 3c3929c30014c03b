"""On a GPU, in bf16: capture on transformers' delta-rule models records what fla's compiled kernels
(or the modeling file's torch fallback) consumed, and its replay agrees with an fp64 replay of that.

The CPU files run fla under Triton's interpreter in fp32 only (its bf16 ``tl.dot`` is wrong). Here
the compiled kernels run on bf16 models with two decoder layers — full attention, then one
linear-attention layer of realistic head size (hidden 1024, heads of 128; the Qwen models with
twice as many value heads as key heads) — batch 2: a 1024-token prompt (the chunk kernel, with a
cache) and one cached decoding step (the fused recurrent kernel). For every model and for fla's
kernels and the torch fallback:

(i)   the record holds the tensors the recurrence consumed: q and k bitwise what fla's chunk kernel
      stored (``l2norm_fwd``, bf16) or what the fallback's ``l2norm`` returned (fp32), and within
      1e-6 of fp32 normalisation on the fused path (registers); v, β, g bitwise as passed;
(ii)  the package's GPU replay (``backend="triton"``) agrees per token with the fp64 replay of those
      tensors: residual ratios within 1e-5 relative to max(ratio, 1e-3) at p99 over tokens with a
      non-negligible loss, their geometric mean within 1e-6 relative;
(iii) the replay passes its own output and final-state checks at their default tolerances;
(iv)  the model's logits with and without capture are bitwise equal.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from _hf_models import MODELS, decode_step, fallback_bound, tiny_model
from _hf_oracle import (
    consumed,
    fp64_delta_rule,
    normalise_fp32,
    relative_error,
    spy_fallback_qk,
    spy_kernel_calls,
    spy_stored_qk,
)
from osdn_diag.capture.context import capture
from osdn_diag.replay import replay_call

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fla's compiled kernels)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1: fla's kernels would be interpreted, not compiled"),
    pytest.mark.usefixtures("fla_kernels"),
]

DEVICE, DTYPE = "cuda", torch.bfloat16
BATCH, PROMPT = 2, 1024
LAYERS = ("full_attention", "linear_attention")
#: realistic linear-attention heads on a small model (the tiny presets' other settings)
SHAPE = {
    "qwen3_next": dict(hidden_size=1024, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                       linear_value_head_dim=128, head_dim=128, num_attention_heads=8, num_key_value_heads=2),
    "qwen3_5": dict(hidden_size=1024, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                    linear_value_head_dim=128, head_dim=128, num_attention_heads=8, num_key_value_heads=2),
    "qwen3_5_moe": dict(hidden_size=1024, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                        linear_value_head_dim=128, head_dim=128, num_attention_heads=8, num_key_value_heads=2),
    "kimi_linear": dict(hidden_size=1024, linear_num_heads=8, linear_head_dim=128, num_attention_heads=8,
                        num_key_value_heads=8, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64,
                        v_head_dim=128),
    "olmo_hybrid": dict(hidden_size=1024, linear_num_key_heads=8, linear_num_value_heads=8, linear_key_head_dim=96,
                        linear_value_head_dim=192, num_attention_heads=8),
}
IMPLEMENTATIONS = ("fla", "torch")
RATIO_FLOOR = 1e-3


@dataclasses.dataclass
class Run:
    plain: list
    hooked: list
    calls: list
    raw: list
    stored: list


@pytest.fixture(scope="module")
def runs():
    memo = {}

    def get(model: str, implementation: str) -> Run:
        if (model, implementation) not in memo:
            _, module, names = MODELS[model]
            net = tiny_model(model, LAYERS, seed=1, dtype=DTYPE, device=DEVICE, **SHAPE[model])
            saved = {}
            if implementation == "torch":
                import sys

                mod = sys.modules[module]
                for name, fn in fallback_bound(model).items():
                    saved[name] = getattr(mod, name)
                    setattr(mod, name, fn)
            try:
                gen = torch.Generator(device=DEVICE).manual_seed(3)
                ids = torch.randint(3, net.config.vocab_size, (BATCH, PROMPT), device=DEVICE, generator=gen)
                step = torch.randint(3, net.config.vocab_size, (BATCH, 1), device=DEVICE, generator=gen)

                def forward():
                    out = net(ids, use_cache=True)
                    return [out.logits, decode_step(net, step, out.past_key_values).logits]

                spy_qk = spy_stored_qk() if implementation == "fla" else spy_fallback_qk(module)
                with torch.no_grad():
                    plain = forward()
                    with capture(net, kernels="fla") as cap, spy_kernel_calls(module, names) as raw, spy_qk as qk:
                        hooked = forward()
            finally:
                import sys

                for name, fn in saved.items():
                    setattr(sys.modules[module], name, fn)
            memo[(model, implementation)] = Run(plain, hooked, list(cap.calls), raw, qk)
        return memo[(model, implementation)]

    return get


def _p99(x: torch.Tensor) -> float:
    return float(torch.quantile(x.double().flatten(), 0.99))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("model", list(MODELS))
def test_bf16_capture_is_what_was_consumed(runs, model, implementation):
    run = runs(model, implementation)
    for plain, hooked in zip(run.plain, run.hooked):
        assert torch.equal(plain, hooked)  # (iv)
    assert [c.flags["path"] for c in run.calls] == ["chunk", "fused_recurrent"]
    assert all(c.flags["kernels"] == implementation for c in run.calls)
    for i, (call, raw) in enumerate(zip(run.calls, run.raw)):
        chunk = i == 0
        if implementation == "torch":
            want = consumed(raw, stored_qk=run.stored[i])
        else:
            want = consumed(raw, stored_qk=run.stored[0] if chunk else None)
        for name in ("q", "k"):  # (i)
            if chunk or implementation == "torch":
                assert torch.equal(getattr(call, name), want[name].float()), name
            else:
                assert relative_error(getattr(call, name), want[name]) <= 1e-6, name
        for name in ("v", "beta", "g"):
            assert torch.equal(getattr(call, name), want[name].float()), name
        if not chunk:
            assert torch.equal(call.initial_state, want["initial_state"].float())

        ref = fp64_delta_rule(want["q"], want["k"], want["v"], want["beta"], want["g"], want["scale"],
                              want["initial_state"])
        res = replay_call(call, backend="triton")  # (iii): default tolerances
        B, steps, H = call.beta.shape
        ratio = res.columns["residual_ratio"].reshape(B, H, steps).transpose(1, 2).to(ref.ratio.device)
        ok = ref.loss_before > 1e-6 * ref.loss_before.median()
        diff = (ratio.double() - ref.ratio).abs()[ok] / ref.ratio.abs()[ok].clamp_min(RATIO_FLOOR)
        geo = ratio.double().clamp_min(1e-30).log().mean().exp()
        geo_ref = ref.ratio.clamp_min(1e-30).log().mean().exp()
        print(f"{model} {implementation} {call.flags['path']} ({res.kernel} replay): fidelity {res.fidelity:.2e}, "
              f"state {res.state_fidelity:.2e}, ratio p99 {_p99(diff):.2e}, q_geo {float(geo / geo_ref) - 1:.2e}",
              flush=True)
        assert _p99(diff) <= 1e-5  # (ii)
        assert abs(float(geo / geo_ref) - 1) <= 1e-6


def test_fused_path_normalises_in_fp32_registers():
    """The oracle's fp32 normalisation is the fused kernels' arithmetic: a check of the oracle."""
    x = torch.randn(2, 3, 4, 128, device=DEVICE, dtype=DTYPE)
    y = normalise_fp32(x)
    assert y.dtype == torch.float32 and torch.allclose(y.norm(dim=-1), torch.ones(2, 3, 4, device=DEVICE), atol=1e-5)
