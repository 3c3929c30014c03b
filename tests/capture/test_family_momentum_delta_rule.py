"""fla 0.6.0's momentum delta rule kernels, recorded under capture and replayed, against a loop here.

The fp64 loop below shares no code with the package: it runs fla's recurrence in fla's own K×V
layout (``w = p̃ᵀS − vᵀ``, ``M ← μM + k̃ w``, ``S ← αS − βM``, ``o = Sᵀ(scale·q)``) and measures the
token-local loss ``½‖Sᵀk − v‖²`` on the token's own normalised key. The kernels are called directly
(through a stand-in layer whose forward calls the entry point as ``fla.layers.momentum_deltanet``
imports it, which is where capture hooks it), on awkward inputs:

* the fused recurrent path in fp32: several rows, an initial state *and* momentum buffer, β near 0,
  near 1 and at 2, zero keys, the layer's flags off (``use_p_times_alpha``, in-kernel l2 norm);
* the chunk path (which refuses fp32) in bf16 at T = 70 (not a multiple of 64) and T = 128 (its own
  final state, not the recurrent fallback fla takes for a padded tail), where momentum and state
  decay slowly — and at fast momentum decay, where fla's chunk form is far from its own recurrence
  and replay must refuse it with an error that says what to do;
* packed sequences (``cu_seqlens``): fla refuses them; the reference stand-in takes them;
* a NaN input excludes exactly its stream.

Every per-token ``loss_before``, ``loss_after``, ``residual_ratio`` (and the post-decay ratio), the
output and the final state and momentum buffer are compared with the loop.
"""

from __future__ import annotations

import math

import pytest
import torch

from osdn_diag.capture.context import capture
from osdn_diag.replay import FidelityError, replay_call
from osdn_diag.replay import families

pytestmark = pytest.mark.usefixtures("fla_interpreter")

K, V = 8, 6


def _stand_in_layer(kernel: str):
    """A MomentumDeltaNet whose forward calls one kernel entry point with the given arguments."""
    import fla.layers.momentum_deltanet as site
    from fla.layers import MomentumDeltaNet

    class KernelLayer(MomentumDeltaNet):
        def __init__(self):
            torch.nn.Module.__init__(self)

        def forward(self, **kw):
            return getattr(site, kernel)(**kw)

    return KernelLayer()


def _norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(Σx² + 1e-6) in fp32, stored in x's dtype (what l2norm_fwd hands the recurrence)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _consumed(kw: dict) -> dict:
    """What fla's recurrence reads, rebuilt from the raw arguments (fla's dtype roundings)."""
    dt = kw["q"].dtype
    l2 = kw.get("use_qk_l2norm_in_kernel", True)
    q, k = (_norm(kw[n]) if l2 else kw[n] for n in ("q", "k"))
    p = k
    wk = (k * kw["eta"][..., None]).to(dt)
    pk = (p * kw["log_alpha"].exp()[..., None]).to(dt) if kw.get("use_p_times_alpha", True) else p
    return dict(q=q, k=k, wk=wk, pk=pk)


def _loop(q, k, v, wk, pk, beta, log_alpha, log_mu, scale, S0=None, M0=None, offsets=None):
    """fp64, fla's K×V layout. Returns o [B,T,H,V], S and M [N,H,K,V], losses [B,T,H] (before,
    before after the decay, after)."""
    B, T, H, Kd = k.shape
    Vd = v.shape[-1]
    f = lambda x: x.double()  # noqa: E731
    q, k, v, wk, pk, beta, la, lm = map(f, (q, k, v, wk, pk, beta, log_alpha, log_mu))
    segs = [(b, 0, T) for b in range(B)] if offsets is None else [
        (0, s, e) for s, e in zip(offsets[:-1], offsets[1:])]
    o = torch.zeros(B, T, H, Vd, dtype=torch.float64)
    losses = torch.zeros(3, B, T, H, dtype=torch.float64)
    Sf = torch.zeros(len(segs), H, Kd, Vd, dtype=torch.float64)
    Mf = torch.zeros_like(Sf)
    for n, (b, s, e) in enumerate(segs):
        for h in range(H):
            S = torch.zeros(Kd, Vd, dtype=torch.float64) if S0 is None else S0[n, h].double().clone()
            M = torch.zeros(Kd, Vd, dtype=torch.float64) if M0 is None else M0[n, h].double().clone()
            for t in range(s, e):
                kt, vt = k[b, t, h], v[b, t, h]
                alpha, mu = math.exp(float(la[b, t, h])), math.exp(float(lm[b, t, h]))
                loss = lambda X: 0.5 * float(((X.T @ kt - vt) ** 2).sum())  # noqa: E731
                losses[0, b, t, h] = loss(S)
                losses[1, b, t, h] = loss(alpha * S)
                w = pk[b, t, h] @ S - vt
                M = mu * M + torch.outer(wk[b, t, h], w)
                S = alpha * S - float(beta[b, t, h]) * M
                losses[2, b, t, h] = loss(S)
                o[b, t, h] = S.T @ (scale * q[b, t, h])
            Sf[n, h], Mf[n, h] = S, M
    return o, Sf, Mf, losses


def _inputs(gen, B, T, H, dtype=torch.float32, mu=(-2.0, 0.0), alpha=(-0.5, 0.0)):
    r = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    return dict(
        q=torch.randn(B, T, H, K, generator=gen).to(dtype),
        k=torch.randn(B, T, H, K, generator=gen).to(dtype),
        v=torch.randn(B, T, H, V, generator=gen).to(dtype),
        log_alpha=alpha[0] + (alpha[1] - alpha[0]) * r(B, T, H),
        log_mu=mu[0] + (mu[1] - mu[0]) * r(B, T, H),
        beta=r(B, T, H),
        eta=2 * r(B, T, H),
    )


def _run(kernel: str, kw: dict, kernels: str = "fla"):
    layer = _stand_in_layer(kernel)
    with torch.no_grad(), capture(layer, kernels=kernels) as cap:
        out = layer(**kw)
    assert len(cap.calls) == 1
    return out, cap.calls[0]


def _grid(columns: dict, call, name: str) -> torch.Tensor:
    """A per-token column of replay_call back in the call's [B, T, H] layout."""
    B, T, H = call.beta.shape
    out = torch.full((B, T, H), float("nan"), dtype=torch.float64)
    segs = call.segments()
    for i in range(len(columns["pos"])):
        row, start, _ = segs[int(columns["sequence"][i])]
        out[row, start + int(columns["pos"][i]), int(columns["head"][i])] = float(columns[name][i])
    return out


def _ratio(after, before):
    return torch.where(before == 0, torch.ones_like(before), after / torch.where(before == 0, 1.0, before))


def _close(x, ref, rel, floor):
    """max |x − ref| / max(|ref|, floor)."""
    return float(((x.double() - ref.double()).abs() / ref.double().abs().clamp_min(floor)).max())


def _check_against_loop(call, kw, rel=1e-5, offsets=None, S0=None, M0=None, consumed=None):
    c = consumed or _consumed(kw)
    o, Sf, Mf, (before, before_dec, after) = _loop(
        c["q"], c["k"], kw["v"], c["wk"], c["pk"], kw["beta"], kw["log_alpha"], kw["log_mu"],
        K**-0.5, S0, M0, offsets)
    res = replay_call(call)
    cols = res.columns
    for name, ref in (("loss_before", before), ("loss_after", after), ("loss_before_decayed", before_dec)):
        got = _grid(cols, call, name)
        scale = before.abs().amax().clamp_min(1e-30)  # losses near 0 are only as exact as their sum
        assert float((got - ref).abs().max() / scale) <= rel, name
    q_ref = _ratio(after, before)
    assert _close(_grid(cols, call, "residual_ratio"), q_ref, rel, 1e-2) <= 10 * rel
    assert _close(_grid(cols, call, "residual_ratio_post"), _ratio(after, before_dec), rel, 1e-2) <= 10 * rel
    rep = families.replays()["momentum_delta_rule"](call, dtype=torch.float32, bad=None, backend="torch")
    assert float((rep.o.double() - o).norm() / o.norm()) <= rel
    assert float((rep.final_state.double() - Sf.transpose(-1, -2)).norm() / Sf.norm()) <= rel
    assert float((rep.final_momentum.double() - Mf.transpose(-1, -2)).norm() / Mf.norm()) <= rel
    return o, Sf, Mf, res


def test_fused_recurrent_fp32_rows_initial_state_and_momentum():
    gen = torch.Generator().manual_seed(0)
    B, T, H = 2, 23, 2
    kw = _inputs(gen, B, T, H)
    S0 = torch.randn(B, H, K, V, generator=gen) * 0.3
    M0 = torch.randn(B, H, K, V, generator=gen) * 0.3
    kw.update(initial_state=torch.stack([S0, M0]), output_final_state=True)
    out, call = _run("fused_recurrent_momentum_delta_rule", kw)
    assert call.family == "momentum_delta_rule" and call.flags["path"] == "fused_recurrent"
    assert set(call.extra) == {"residual_key", "log_mu", "initial_momentum", "final_momentum"}
    o, Sf, Mf, res = _check_against_loop(call, kw, S0=S0, M0=M0)
    # The kernel itself is the loop's recurrence, and the caller got its own final state.
    assert float((out[0].double() - o).norm() / o.norm()) <= 1e-5
    assert float((out[1][0].double() - Sf).norm() / Sf.norm()) <= 1e-5
    assert float((out[1][1].double() - Mf).norm() / Mf.norm()) <= 1e-5
    assert res.state_fidelity <= 1e-5 and res.fidelity <= 1e-5


def test_the_output_check_measures_the_kernel_against_an_independent_replay():
    """fla's fused recurrent path is an fp32 torch loop of the recurrence's own operations: a replay
    repeating them in fp32 would agree to the last bit. The replay runs in fp64, so the check reads the
    kernel's real fp32 rounding (nonzero, far below the tolerance), and a record off by 1 % in one
    token's β fails it."""
    gen = torch.Generator().manual_seed(5)
    kw = {**_inputs(gen, 2, 40, 2), "output_final_state": True}
    _, call = _run("fused_recurrent_momentum_delta_rule", kw)
    res = replay_call(call)
    assert 1e-9 < res.fidelity <= 1e-5 and 1e-9 < res.state_fidelity <= 1e-5
    rep = families.replays()["momentum_delta_rule"](call, dtype=torch.float32, bad=None, backend="torch")
    assert rep.o.dtype == rep.loss_before.dtype == rep.final_momentum.dtype == torch.float32
    call.beta[1, 3, 1] *= 1.01  # planted: the record is not what the kernel read
    with pytest.raises(FidelityError):
        replay_call(call)


def test_fused_recurrent_edge_betas_zero_keys_and_flags_off():
    gen = torch.Generator().manual_seed(1)
    B, T, H = 1, 30, 3
    kw = _inputs(gen, B, T, H)
    kw["beta"][0, :10] = 1e-6          # β near 0
    kw["beta"][0, 10:20] = 1 - 1e-6    # near 1
    kw["beta"][0, 20:, 0] = 2.0        # the layer's allow_neg_eigval range
    kw["k"][0, 5, 1] = 0.0             # zero keys: nothing written along them, q = 1
    kw["k"][0, 15] = 0.0
    _, call = _run("fused_recurrent_momentum_delta_rule", kw)
    _, _, _, res = _check_against_loop(call, kw)
    q = _grid(res.columns, call, "residual_ratio")
    assert q[0, 15].eq(1.0).all() and q[0, 5, 1] == 1.0
    # The layer's two flags off: p is then used undecayed, and q, k unnormalised.
    kw2 = {**_inputs(gen, B, 17, H), "use_p_times_alpha": False, "use_qk_l2norm_in_kernel": False}
    _, call2 = _run("fused_recurrent_momentum_delta_rule", kw2)
    assert call2.flags["use_p_times_alpha"] is False
    _check_against_loop(call2, kw2)


@pytest.mark.parametrize("T", [70, 128])
def test_chunk_bf16_slow_decay(T):
    gen = torch.Generator().manual_seed(T)
    kw = _inputs(gen, 1, T, 2, dtype=torch.bfloat16, mu=(-0.05, 0.0), alpha=(-0.05, 0.0))
    kw["output_final_state"] = True
    out, call = _run("chunk_momentum_delta_rule", kw)
    assert call.flags["path"] == "chunk" and call.input_dtype == "bfloat16"
    # The record holds the bf16 tensors fla's recurrence read: its own l2 norm, and η k, α p
    # formed in fp32 and rounded to bf16.
    c = _consumed(kw)
    ulp = 2.0**-8
    assert float((call.k - c["k"].float()).abs().max()) <= ulp
    assert torch.equal(call.write_key, (call.k.bfloat16() * kw["eta"][..., None]).bfloat16().float())
    assert torch.equal(call.extra["residual_key"],
                       (call.k.bfloat16() * kw["log_alpha"].exp()[..., None]).bfloat16().float())
    rec = dict(q=call.q, k=call.k, wk=call.write_key, pk=call.extra["residual_key"])
    # The replay is the loop on the record (fp32 vs fp64), and the chunk form agrees with both at bf16.
    o, Sf, _, res = _check_against_loop(call, kw, consumed=rec)
    assert res.fidelity <= 1e-2
    assert float((out[0].double() - o).norm() / o.norm()) <= 1e-2
    assert float((out[1][0].double() - Sf).norm() / Sf.norm()) <= 1e-2


def test_chunk_form_refused_at_fast_momentum_decay():
    gen = torch.Generator().manual_seed(7)
    kw = _inputs(gen, 1, 64, 2, dtype=torch.bfloat16, mu=(-1.0, -1.0), alpha=(0.0, 0.0))
    kw["output_final_state"] = True
    _, call = _run("chunk_momentum_delta_rule", kw)
    with pytest.raises(FidelityError, match="chunk form.*not the record.*fused_recurrent"):
        replay_call(call)
    # --tolerance accepts the chunk form's error as it is.
    assert replay_call(call, tolerance=math.inf).fidelity > 0.1
    # The same inputs on the fused recurrent path replay cleanly.
    _, call_fr = _run("fused_recurrent_momentum_delta_rule", kw)
    assert replay_call(call_fr).fidelity <= 1e-2


def test_packed_sequences_refused_by_fla_taken_by_the_reference():
    gen = torch.Generator().manual_seed(3)
    kw = _inputs(gen, 1, 29, 2)
    offsets = [0, 11, 29]
    kw["cu_seqlens"] = torch.tensor(offsets)
    with pytest.raises(NotImplementedError):
        _run("fused_recurrent_momentum_delta_rule", kw)
    S0 = torch.randn(2, 2, K, V, generator=gen) * 0.3
    M0 = torch.randn(2, 2, K, V, generator=gen) * 0.3
    kw.update(initial_state=torch.stack([S0, M0]), output_final_state=True)
    _, call = _run("fused_recurrent_momentum_delta_rule", kw, kernels="reference")
    assert call.flags["kernels"] == "reference"
    _check_against_loop(call, kw, offsets=offsets, S0=S0, M0=M0)


def test_a_nonfinite_input_excludes_its_stream_and_a_misread_buffer_is_refused():
    gen = torch.Generator().manual_seed(4)
    kw = _inputs(gen, 2, 12, 2)
    kw["output_final_state"] = True
    kw["log_mu"][1, 4, 0] = float("nan")
    _, call = _run("fused_recurrent_momentum_delta_rule", kw)
    res = replay_call(call)
    assert res.nonfinite == 1 and res.nonfinite_streams == [(1, 0)]
    kw["log_mu"][1, 4, 0] = -0.5
    _, call = _run("fused_recurrent_momentum_delta_rule", kw)
    call.extra["final_momentum"] = call.extra["final_momentum"] * 1.01
    with pytest.raises(FidelityError, match="momentum buffer"):
        replay_call(call)
