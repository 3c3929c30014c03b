"""Paths the review found untested (issue 19, item 4): a NaN in a captured preconditioner ``d``, an
explicit non-default ``scale`` through capture and replay, ``log_bound``'s NaN / -inf contract, and
the audit's boundaries β = 1/d_max, β = 0, β = 1.

Every expectation is computed here: constants written out, fp64 loops written in this file.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from osdn_diag.capture import KernelCall
from osdn_diag.capture.store import StoredCall
from osdn_diag.math.closed_forms import log_bound
from osdn_diag.metrics.audit import AuditAccumulator
from osdn_diag.replay import replay_call
from osdn_diag.replay.replayer import Replayer

F64 = torch.float64


def _delta_loop(q, k, v, beta, write_key, scale):
    """fp64 delta rule, S is V×K, S_0 = 0: e = S k − v, S ← S − β e wkᵀ, o = S (scale q).
    Returns o [B, T, H, V], the final S [B, H, V, K] and the losses ½‖S k − v‖² before/after."""
    q, k, v, beta, wk = (x.to(F64) for x in (q, k, v, beta, write_key))
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = torch.zeros(B, H, V, K, dtype=F64)
    o = torch.zeros(B, T, H, V, dtype=F64)
    before = torch.zeros(B, T, H, dtype=F64)
    after = torch.zeros(B, T, H, dtype=F64)
    for t in range(T):
        e = torch.einsum("bhvk,bhk->bhv", S, k[:, t]) - v[:, t]
        before[:, t] = 0.5 * e.square().sum(-1)
        S = S - beta[:, t, :, None, None] * e[..., None] * wk[:, t, :, None, :]
        after[:, t] = 0.5 * (torch.einsum("bhvk,bhk->bhv", S, k[:, t]) - v[:, t]).square().sum(-1)
        o[:, t] = torch.einsum("bhvk,bhk->bhv", S, scale * q[:, t])
    return o, S, before, after


# --- 1. NaN in a captured preconditioner d -----------------------------------------------------

B1, T1, H1, K1, V1 = 2, 16, 2, 8, 4
BAD_SEQ, BAD_T, BAD_HEAD = 1, 5, 0  # the (sequence, token, head) whose d holds a NaN


def _precond_call(d=None, o=None, final_state=None):
    g = torch.Generator().manual_seed(19)
    k = torch.nn.functional.normalize(torch.randn(B1, T1, H1, K1, generator=g), dim=-1)
    q = torch.randn(B1, T1, H1, K1, generator=g)
    v = torch.randn(B1, T1, H1, V1, generator=g)
    beta = 0.05 + 0.9 * torch.rand(B1, T1, H1, generator=g)
    d0 = 0.5 + 1.5 * torch.rand(B1, T1, H1, K1, generator=g)
    d = d0 if d is None else d
    o_ref, S_ref, _, _ = _delta_loop(q, k, v, beta, d0 * k, K1**-0.5)
    return KernelCall(
        layer=0, layer_name="layers.0.attn", family="precond_gated_delta_rule",
        kernel="fused_recurrent_precond_gated_delta_rule", q=q, k=k, v=v, beta=beta, d=d,
        o=(o_ref if o is None else o).float(), scale=K1**-0.5,
        final_state=(S_ref if final_state is None else final_state).float(),
        flags={"kernels": "fla", "path": "fused_recurrent", "device": "cpu"},
    )


def test_nan_in_d_flags_its_stream_and_leaves_the_others_exact():
    clean = _precond_call()
    d = clean.d.clone()
    d[BAD_SEQ, BAD_T, BAD_HEAD, 3] = float("nan")
    # What the kernel returns when d holds a NaN: its output and state go NaN on that stream from there.
    o = clean.o.clone()
    o[BAD_SEQ, BAD_T:, BAD_HEAD] = float("nan")
    S = clean.final_state.clone()
    S[BAD_SEQ, BAD_HEAD] = float("nan")
    dirty = replace(clean, d=d, o=o, final_state=S)

    ref = replay_call(clean)
    res = replay_call(dirty)  # must not raise
    c, rc = res.columns, ref.columns
    bad = (c["sequence"] == BAD_SEQ) & (c["head"] == BAD_HEAD)
    assert int(bad.sum()) == T1
    assert not c["finite"][bad].any() and c["finite"][~bad].all()
    assert res.nonfinite == 1 and res.nonfinite_streams == [(BAD_SEQ, BAD_HEAD)]
    assert not res.grid["finite"][BAD_SEQ, :, BAD_HEAD].any()  # every token of the stream
    assert int(res.grid["finite"].sum()) == (B1 * H1 - 1) * T1
    assert ref.nonfinite == 0 and rc["finite"].all()
    for name in ("residual_ratio", "loss_before", "loss_after", "write_gain", "sequence", "head", "pos"):
        assert torch.equal(c[name][~bad], rc[name][~bad]), name
    assert res.fidelity == ref.fidelity and res.state_fidelity == ref.state_fidelity
    assert math.isfinite(res.fidelity) and res.fidelity <= 1e-5

    # The replayer: the stream is counted and left out; q_geo is over the three other streams.
    rep = Replayer({10: {"task": "a"}, 11: {"task": "a"}}, device="cpu", comparator=False)
    rep.add(StoredCall(batch=0, prompts=[10, 11], call=dirty))
    s = rep.summary()
    assert s["nonfinite_heads_by_layer"] == {"000": 1}
    assert s["nonfinite"] == {"streams": 1, "of_streams": 4, "tokens": T1,
                              "by_layer": {"000": 1}, "prompts": [11]}
    assert s["excluded_nonfinite"] == T1
    assert s["n"] == 3 * T1 and s["assumptions"]["n"] == 3 * T1
    _, _, before, after = _delta_loop(clean.q, clean.k, clean.v, clean.beta, clean.d * clean.k, K1**-0.5)
    ratio = after / before
    keep = torch.ones(B1, T1, H1, dtype=torch.bool)
    keep[BAD_SEQ, :, BAD_HEAD] = False
    want = math.exp(ratio[keep].clamp_min(1e-30).log().mean().item())
    assert s["q_geo"] == pytest.approx(want, rel=1e-5)
    assert s["by_head"]["000.000"]["n"] == T1 and s["by_head"]["000.001"]["n"] == 2 * T1


# --- 2. an explicit non-default scale through capture and replay ------------------------------

B2, T2, H2, K2, V2 = 1, 20, 2, 16, 8
SCALE = 0.3


def test_explicit_scale_is_recorded_and_replayed(fla_interpreter):
    import fla.layers.delta_net as dn

    from osdn_diag.capture.context import capture

    class ExplicitScaleDeltaNet(dn.DeltaNet):
        """A DeltaNet layer whose forward calls the kernel by its name in fla.layers.delta_net (the
        name capture intercepts) with scale given explicitly."""

        def forward(self, q, k, v, beta):
            return dn.fused_recurrent_delta_rule(q, k, v, beta, scale=SCALE, output_final_state=False,
                                                 use_qk_l2norm_in_kernel=False)

    g = torch.Generator().manual_seed(4)
    k = torch.nn.functional.normalize(torch.randn(B2, T2, H2, K2, generator=g), dim=-1)
    q = torch.randn(B2, T2, H2, K2, generator=g)
    v = torch.randn(B2, T2, H2, V2, generator=g)
    beta = 0.05 + 0.9 * torch.rand(B2, T2, H2, generator=g)
    layer = ExplicitScaleDeltaNet(hidden_size=64, num_heads=2, layer_idx=0).eval()
    with torch.no_grad(), capture(layer, kernels="fla") as cap:
        o_kernel, _ = layer(q, k, v, beta)
    assert len(cap.calls) == 1
    call = cap.calls[0]
    assert call.kernel == "fused_recurrent_delta_rule" and call.flags["kernels"] == "fla"
    assert call.scale == 0.3
    assert torch.equal(call.o, o_kernel.float())

    res = replay_call(call, tolerance=1e-5)
    assert res.fidelity <= 1e-5

    o_ref, _, _, _ = _delta_loop(q, k, v, beta, k, 0.3)
    o_kernel = o_kernel.to(F64)
    assert ((o_kernel - o_ref).norm() / o_ref.norm()).item() <= 1e-5
    # The scale matters: fla's default K^-1/2 = 0.25 gives another output.
    o_default, _, _, _ = _delta_loop(q, k, v, beta, k, 16**-0.5)
    assert ((o_kernel - o_default).norm() / o_ref.norm()).item() > 0.1


# --- 3. log_bound's documented NaN / -inf contract --------------------------------------------


def test_log_bound_negative_base_is_nan_and_zero_base_is_minus_inf():
    """T·log(2ε + 2R/T): NaN for a negative base (hypotheses fail), -inf for a zero one (also one
    within a few ulps below 0: rounding of a true 0), the plain value for a positive one."""
    T = 4
    t = lambda *x: torch.tensor(x, dtype=F64)  # noqa: E731
    eps = t(0.05, 0.25, 0.25, 0.25, 0.3, 0.0)
    reg = t(-1.0, -1.0, -1.0 - 4e-16, -1.0 - 1e-10, 0.4, -0.5)
    # bases: -0.4, 0, ≈ -2e-16 (within tolerance), ≈ -5e-11 (beyond it), 0.8, -0.25
    out = log_bound(eps, reg, T)
    assert math.isnan(out[0]) and math.isnan(out[3]) and math.isnan(out[5])
    assert out[1] == -math.inf and out[2] == -math.inf
    assert out[4].item() == pytest.approx(4 * math.log(0.8), rel=1e-15)
    assert int(torch.isfinite(out).sum()) == 1  # never a silently finite number for base ≤ 0


# --- 4. the audit's boundaries ----------------------------------------------------------------


def _audit(beta_values, box=(0.5, 2.0)):
    """One head, one token per β; unit keys, losses 1, every token finite."""
    beta = torch.tensor(beta_values, dtype=torch.float32).reshape(1, -1, 1)
    T = beta.shape[1]
    k = torch.zeros(1, T, 1, 4)
    k[..., 0] = 1.0
    zeros = torch.zeros(1, T, 1, 4)
    call = KernelCall(layer=0, layer_name="l", family="x", kernel="x", q=zeros, k=k, v=zeros,
                      beta=beta, o=zeros, scale=1.0)
    acc = AuditAccumulator(box=box)
    acc.add(call, torch.ones(1, T, 1), torch.ones(1, T, 1, dtype=torch.bool))
    return acc.summary()


def test_audit_newton_infeasible_boundary_and_open_unit_interval():
    below = torch.nextafter(torch.tensor(0.5), torch.tensor(0.0)).item()  # largest fp32 < 1/2
    assert below < 0.5
    # d_max = 2: β = 1/2 exactly is feasible (β d_max = 1), the next fp32 below is not.
    s = _audit([0.5, 0.5, 0.5, below], box=(0.5, 2.0))
    assert s["n"] == 4 and s["share_newton_infeasible"] == 0.25
    assert _audit([0.5], box=(0.5, 2.0))["share_newton_infeasible"] == 0.0
    assert _audit([below], box=(0.5, 2.0))["share_newton_infeasible"] == 1.0
    # d_max = 4: the boundary moves to 1/4.
    below_q = torch.nextafter(torch.tensor(0.25), torch.tensor(0.0)).item()
    s = _audit([0.25, below_q, 0.5, 0.125], box=(0.25, 4.0))
    assert s["share_newton_infeasible"] == 0.5

    # β ∈ (0, 1): both ends excluded, the nearest fp32 values inside included.
    s = _audit([0.0, 0.5])
    assert s["beta_min"] == 0.0 and s["hypotheses_failed"]["beta_in_open_unit_interval"] == 1
    assert s["hypotheses_hold"] == 0
    s = _audit([0.5, 1.0])
    assert s["beta_max"] == 1.0 and s["hypotheses_failed"]["beta_in_open_unit_interval"] == 1
    assert s["hypotheses_hold"] == 0
    tiny = torch.nextafter(torch.tensor(0.0), torch.tensor(1.0)).item()
    near_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()
    s = _audit([tiny, near_one])
    assert s["hypotheses_failed"]["beta_in_open_unit_interval"] == 0 and s["hypotheses_hold"] == 1
