"""Finite inputs whose token losses overflow the replay's dtype (a diverging model's values, ‖v‖ near
1e20 in fp32): refused with where and what to do, never reported as NaN ratios on rows marked finite."""

from __future__ import annotations

import pytest
import torch

import osdn_diag
from osdn_diag.capture import KernelCall
from osdn_diag.replay.call import ReplayOverflowError


def _call(scale_v: float, dtype=torch.float32, K: int = 4):
    g = torch.Generator().manual_seed(0)
    B, T, H = 2, 9, 2
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    v[0, :, 1] *= scale_v  # sequence 0, head 1
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64) * 0.8 + 0.1
    S, o = torch.zeros(B, H, K, K, dtype=torch.float64), torch.empty_like(v)  # the kernel's outputs
    for t in range(T):
        kt = k[:, t]
        S = S + beta[:, t, :, None, None] * (v[:, t] - torch.einsum("bhvk,bhk->bhv", S, kt))[..., None] * kt[:, :, None]
        o[:, t] = torch.einsum("bhvk,bhk->bhv", S, 0.5 * kt)
    return KernelCall(layer=3, layer_name="blk3", family="delta_rule", kernel="fused_recurrent_delta_rule",
                      q=k.to(dtype), k=k.to(dtype), v=v.to(dtype), beta=beta.to(dtype), o=o.to(dtype), scale=0.5,
                      flags={"kernels": "reference", "device": "cpu"})


def test_overflowing_losses_are_refused_naming_the_layer_the_stream_and_fp64():
    with pytest.raises(ReplayOverflowError, match=r"layer 3 \(blk3.*of 9 token-heads overflow float32 \(the first "
                                                  r"at sequence 0, head 1, position 0.*replay in fp64"):
        osdn_diag.replay([_call(1e20)])
    assert issubclass(ReplayOverflowError, ValueError)  # the command line prints it as one line, exit 2


def test_in_fp64_the_same_writes_have_the_ratios_of_unscaled_values():
    """With a zero initial state the residuals scale with v: the ratios of v·1e20 are those of v."""
    big = osdn_diag.replay([_call(1e20, torch.float64)], dtype=torch.float64)
    plain = osdn_diag.replay([_call(1.0, torch.float64)], dtype=torch.float64)
    a, b = (r.table.sort_by([("prompt", "ascending"), ("head", "ascending"), ("pos", "ascending")]).to_pydict()
            for r in (big, plain))
    assert all(a["finite"]) and min(a["residual_ratio"]) > 0
    assert a["residual_ratio"] == pytest.approx(b["residual_ratio"], rel=1e-12)
    assert big.summary["q_geo"] == pytest.approx(plain.summary["q_geo"], rel=1e-12)


def _on_gpu(call):
    import dataclasses

    moved = {f.name: getattr(call, f.name).cuda() for f in dataclasses.fields(call)
             if isinstance(getattr(call, f.name), torch.Tensor)}
    return dataclasses.replace(call, **moved, flags={**call.flags, "device": "cuda"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton replays)")
@pytest.mark.parametrize("backend", ["triton", "fused", "torch"])
def test_overflowing_losses_are_refused_on_every_gpu_backend(backend):
    """Each GPU backend computes the token losses in its own kernel (fp32); the refusal reads their
    host copy, so it names the same row on every one, and the same writes at a sane scale pass."""
    with pytest.raises(ReplayOverflowError, match=r"layer 3 \(blk3.*overflow float32 \(the first at sequence 0, "
                                                  r"head 1, position 0.*replay in fp64"):
        osdn_diag.replay([_on_gpu(_call(1e20, K=16))], device="cuda", backend=backend)
    plain = osdn_diag.replay([_on_gpu(_call(1.0, K=16))], device="cuda", backend=backend)
    assert all(plain.table.column("finite").to_pylist()) and plain.summary["q_geo"] > 0
