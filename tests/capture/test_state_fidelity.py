"""Replay writes with the write key the kernel stored, and checks its final state against the
kernel's own fp32 final state.

Expected values come from a plain fp64 loop written here (no package maths), on hand-built records.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from osdn_diag.capture import KernelCall
from osdn_diag.replay import FidelityError, default_state_tolerance, replay_call, working_precision
from osdn_diag.replay.replayer import Replayer
from osdn_diag.whatif import WhatIf

B, T, H, K, V = 2, 24, 2, 8, 4


def _loop(q, k, v, beta, wk, scale):
    """fp64 delta rule, S is V×K: u = v − S k, S += β u wkᵀ, o = S (scale q); losses before/after."""
    q, k, v, beta, wk = (x.double() for x in (q, k, v, beta, wk))
    S = torch.zeros(B, H, V, K, dtype=torch.float64)
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    before = torch.zeros(B, T, H, dtype=torch.float64)
    after = torch.zeros(B, T, H, dtype=torch.float64)
    for t in range(T):
        kt, vt = k[:, t], v[:, t]
        e = torch.einsum("bhvk,bhk->bhv", S, kt) - vt
        before[:, t] = 0.5 * e.square().sum(-1)
        S = S + beta[:, t, :, None, None] * (-e)[..., None] * wk[:, t, :, None, :]
        after[:, t] = 0.5 * (torch.einsum("bhvk,bhk->bhv", S, kt) - vt).square().sum(-1)
        o[:, t] = torch.einsum("bhvk,bhk->bhv", S, q[:, t] * scale)
    return o, S, before, after


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    q = torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    beta = torch.rand(B, T, H, generator=g) * 0.98 + 0.01
    d = 0.5 + 1.5 * torch.rand(B, T, H, K, generator=g)
    return q, k, v, beta, d


def _call(*, write_key=None, final_state=None, o=None, d=None, flags=None, seed=0):
    q, k, v, beta, d0 = _inputs(seed)
    d = d0 if d is None else d
    wk = d * k if write_key is None else write_key
    o_ref, S_ref, _, _ = _loop(q, k, v, beta, wk, K**-0.5)
    return KernelCall(
        layer=0, layer_name="layers.0.attn", family="precond_gated_delta_rule",
        kernel="fused_recurrent_precond_gated_delta_rule", q=q, k=k, v=v, beta=beta, d=d,
        write_key=write_key, o=(o_ref if o is None else o).float(), scale=K**-0.5,
        final_state=(S_ref if final_state is None else final_state).float(),
        flags={"kernels": "fla", "path": "fused_recurrent", "device": "cpu", **(flags or {})},
    )


def test_replay_writes_with_the_stored_write_key():
    q, k, v, beta, d = _inputs()
    stored = (d * k).to(torch.bfloat16).float()  # what a bf16 chunk kernel stores and writes with
    call = _call(write_key=stored)
    res = replay_call(call)
    _, _, before, after = _loop(q, k, v, beta, stored, K**-0.5)
    want = (after / before).permute(0, 2, 1).reshape(-1)  # rows: sequence, head, position
    got = res.columns["residual_ratio"].double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # Writing with the fp32 product instead moves the ratios by far more than that.
    res_product = replay_call(replace(call, write_key=None), tolerance=math.inf)
    assert (res_product.columns["residual_ratio"].double() - want).abs().max() > 1e-4


def test_state_check_passes_on_the_kernels_state_and_names_layer_kernel_and_path_on_a_misread():
    call = _call()
    res = replay_call(call)
    assert res.state_fidelity is not None and res.state_fidelity <= 1e-6
    assert res.state_tolerance == 1e-4
    assert res.state_rounding_units == pytest.approx(res.state_fidelity / 2.0**-24)
    # A final state off by 1e-3 (what a misread key of that size does) with outputs that still agree.
    bad = replace(call, final_state=call.final_state * (1 + 1e-3))
    with pytest.raises(FidelityError, match=r"layer 0 .*fused_recurrent_precond_gated_delta_rule, "
                                             r"fused_recurrent path.*final state"):
        replay_call(bad)
    assert replay_call(bad, state_tolerance=math.inf).fidelity <= 1e-5
    # Disabling the output check (what-if) disables the state check with it.
    assert replay_call(bad, tolerance=math.inf).state_fidelity == pytest.approx(1e-3, rel=1e-3)
    # NaN never passes.
    nan_state = call.final_state.clone()
    nan_state[0, 0, 0, 0] = float("nan")
    with pytest.raises(FidelityError, match="final state"):
        replay_call(replace(call, final_state=nan_state))


@pytest.mark.parametrize(
    "flags, dtype, precision, tol",
    [
        ({"path": "chunk", "device": "cuda"}, "bfloat16", "bfloat16", 5e-2),
        ({"path": "chunk", "device": "cuda"}, "float16", "float16", 5e-2),
        ({"path": "chunk", "device": "cuda"}, "float32", "tfloat32", 5e-2),
        ({"path": "chunk", "device": "cpu"}, "float32", "float32", 1e-4),
        ({"path": "fused_recurrent", "device": "cuda"}, "bfloat16", "float32", 1e-4),
        ({"path": "naive", "device": "cuda"}, "bfloat16", "bfloat16", 5e-2),
        ({"path": "chunk", "device": "cpu", "kernels": "reference"}, "bfloat16", "float32", 1e-4),
    ],
)
def test_working_precision_and_state_tolerance_by_path(flags, dtype, precision, tol):
    call = replace(_call(flags=flags), input_dtype=dtype)
    assert working_precision(call) == precision
    assert default_state_tolerance(call) == tol


def test_summary_reports_each_layers_worst_state_error():
    """summary.json's fidelity.state: per layer the largest error over its calls, computed here
    from the fp64 loop's state and the recorded kernel state."""
    errs = {}
    rep = Replayer({0: {"task": "t"}, 1: {"task": "t"}}, device="cpu", comparator=False)
    from osdn_diag.capture.store import StoredCall

    for layer, scale in ((0, 1 + 2e-5), (0, 1 + 5e-5), (1, 1 - 3e-5)):
        call = _call()
        q, k, v, beta, d = _inputs()
        _, S, _, _ = _loop(q, k, v, beta, d * k, K**-0.5)
        kernel_state = (S * scale).float()
        call = replace(call, layer=layer, final_state=kernel_state)
        err = ((S - kernel_state.double()).square().sum((-2, -1)).sqrt()
               / kernel_state.double().square().sum((-2, -1)).sqrt()).max().item()
        errs[layer] = max(errs.get(layer, 0.0), err)
        rep.add(StoredCall(batch=0, prompts=[0, 1], call=call))
    state = rep.summary()["fidelity"]["state"]
    for layer, err in errs.items():
        row = state["by_layer"][f"{layer:03d}"]
        assert row["rel_error"] == pytest.approx(err, abs=2e-6)
        assert row["tolerance"] == 1e-4 and row["working_precision"] == "float32"
        assert row["rounding_units"] == pytest.approx(row["rel_error"] * 2.0**24)
    assert state["max_rel_error"] == max(r["rel_error"] for r in state["by_layer"].values())


def test_what_if_drops_the_kernels_write_key_and_state():
    q, k, v, beta, d = _inputs()
    call = _call(write_key=(d * k).to(torch.bfloat16).float())
    counterfactual = WhatIf(eta=0.5)(call)
    assert counterfactual.write_key is None and counterfactual.final_state is None
    assert not torch.equal(counterfactual.d, call.d)
