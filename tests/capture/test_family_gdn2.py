"""fla 0.6.0's GDN-2 kernels (``chunk_gdn2``, ``fused_recurrent_gdn2``) recorded and replayed.

The oracle is a plain fp64 loop written here (:func:`_loop`), sharing nothing with the package, in
fla's own ``K×V`` form of the layer's docstring, ``S_t = (I − k_t (b_t ⊙ k_t)ᵀ) Diag(α_t) S_{t−1} +
k_t (w_t ⊙ v_t)ᵀ``, on q, k normalised as the kernels normalise them. It must reproduce the kernels'
outputs and final states (so it is the recurrence they ran), and then every token's ``loss_before``,
``loss_after``, ``loss_before_decayed`` and ratios of the package's replay (torch backend, and once the
fused Triton replay kernel under the interpreter), for the loss ``½‖S(b ⊙ k) − w ⊙ v‖²`` (``V×K``):
the loss whose residual the kernels compute.

Awkward inputs: T = 70 on the chunk path, packed sequences, an initial state, erase gates near 0 and
near 1 and (``allow_neg_eigval``-style) near 2, a zero key, grouped value heads (fused recurrent path:
the chunk entry point takes q, k already expanded), the in-kernel gate.
fp32 under Triton's interpreter, tiny shapes (H = 2, K = 16, V = 8).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from osdn_diag.capture.families.gdn2 import GDN2Adapter
from osdn_diag.replay import replay_call

pytestmark = pytest.mark.usefixtures("fla_interpreter")

K, V = 16, 8
RTOL = 1e-5


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _loop(q, k, v, g, b, w, h0, bounds, scale):
    """fp64, fla's K×V state per (sequence, head): ``S ← (I − k (b⊙k)ᵀ) Diag(α) S + k (w⊙v)ᵀ``,
    ``o = Sᵀ (scale·q)``; losses ``½‖Sᵀ(b⊙k) − w⊙v‖²`` before (undecayed), after the decay, after."""
    Bn, Tn, HV = v.shape[:3]
    q, k, v, g, b, w = (x.double() for x in (q, k, v, g, b, w))
    o = torch.zeros(Bn, Tn, HV, V, dtype=torch.float64)
    L = {n: torch.zeros(Bn, Tn, HV, dtype=torch.float64) for n in ("before", "decayed", "after")}
    finals = torch.zeros(len(bounds), HV, K, V, dtype=torch.float64)
    eye = torch.eye(K, dtype=torch.float64)
    for n, (row, s, e) in enumerate(bounds):
        for h in range(HV):
            S = torch.zeros(K, V, dtype=torch.float64) if h0 is None else h0[n, h].double().clone()
            for t in range(s, e):
                kt, bk, target = k[row, t, h], b[row, t, h] * k[row, t, h], w[row, t, h] * v[row, t, h]
                L["before"][row, t, h] = 0.5 * ((S.T @ bk - target) ** 2).sum()
                Sd = torch.diag(g[row, t, h].exp()) @ S
                L["decayed"][row, t, h] = 0.5 * ((Sd.T @ bk - target) ** 2).sum()
                S = (eye - torch.outer(kt, bk)) @ Sd + torch.outer(kt, target)
                L["after"][row, t, h] = 0.5 * ((S.T @ bk - target) ** 2).sum()
                o[row, t, h] = S.T @ (scale * q[row, t, h])
            finals[n, h] = S
    return o, finals, L


def _ratio(after, before):
    return torch.where(before == 0, torch.ones_like(after), after / torch.where(before == 0, 1.0, before))


def _inputs(seed, *, Bn, Tn, H=2, HV=2, b_range=(0.0, 1.0), zero_key=False, h0=False, N=None, gate=False):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(Bn, Tn, H, K, generator=gen), torch.randn(Bn, Tn, H, K, generator=gen)
    v = torch.randn(Bn, Tn, HV, V, generator=gen)
    lo, hi = b_range
    b = lo + (hi - lo) * torch.rand(Bn, Tn, HV, K, generator=gen)
    w = torch.rand(Bn, Tn, HV, V, generator=gen)
    g = -0.3 * torch.rand(Bn, Tn, HV, K, generator=gen)
    if zero_key:
        k[:, 2] = 0.0
    out = dict(q=q, k=k, v=v, g=g, b=b, w=w,
               initial_state=0.3 * torch.randn(N or Bn, HV, K, V, generator=gen) if h0 else None)
    if gate:  # raw gate logits; the kernel forms −exp(A_log)·softplus(g + dt_bias)
        out["g"] = torch.randn(Bn, Tn, HV, K, generator=gen)
        out["A_log"] = torch.rand(HV, generator=gen).log()
        out["dt_bias"] = 0.1 * torch.randn(HV * K, generator=gen)
    return out


def _bounds(Bn, Tn, cu):
    return [(r, 0, Tn) for r in range(Bn)] if cu is None else [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]


def _call(path, args, *, cu=None, gate=False):
    from fla.ops.gdn2 import chunk_gdn2, fused_recurrent_gdn2

    fn = chunk_gdn2 if path == "chunk" else fused_recurrent_gdn2
    kw = dict(args, output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate,
              cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.long))
    params = inspect.signature(fn).parameters
    bound = inspect.signature(fn).bind(**{n: x for n, x in kw.items() if n in params},
                                       **{n: x for n, x in kw.items() if n not in params})
    bound.apply_defaults()
    full = dict(bound.arguments)
    full.update(full.pop("kwargs", {}))
    return fn, full, fn(**kw)


def _oracle(args, cu, gate, hv):
    q, k = _l2(args["q"].double()), _l2(args["k"].double())
    rep = hv // q.shape[2]
    q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    g = args["g"].double()
    if gate:
        g = -args["A_log"].double().exp().view(hv, 1) * F.softplus(g + args["dt_bias"].double().view(hv, K))
    Bn, Tn = k.shape[:2]
    return _loop(q, k, args["v"], g, args["b"], args["w"], args["initial_state"], _bounds(Bn, Tn, cu), K**-0.5)


def _check(out, res, ref, Bn, Tn, hv, cu):
    o_ref, final_ref, L = ref
    o, ht = out
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    err_o = float((o.double() - o_ref).norm() / o_ref.norm())
    err_s = float((ht.double() - final_ref).norm() / final_ref.norm())
    assert err_o <= RTOL and err_s <= RTOL, ("the fp64 loop is not the recurrence the kernel ran", err_o, err_s)
    rows = [(r, t, h) for r, s, e in _bounds(Bn, Tn, cu) for h in range(hv) for t in range(s, e)]
    idx = tuple(torch.tensor(x) for x in zip(*rows))
    expect = {
        "loss_before": L["before"][idx], "loss_after": L["after"][idx], "loss_before_decayed": L["decayed"][idx],
        "residual_ratio": _ratio(L["after"], L["before"])[idx],
        "residual_ratio_post": _ratio(L["after"], L["decayed"])[idx],
    }
    for name, want in expect.items():
        got = res.columns[name].double()
        assert torch.isfinite(got).all(), name
        # Ratios relative to max(ratio, 1e-3), losses relative to max(loss, 1e-3 × the token's
        # loss before): a write that cancels its residual leaves a loss of rounding size.
        floor = 1e-3 if "ratio" in name else 1e-3 * expect["loss_before"] + 1e-30
        err = float(((got - want).abs() / torch.maximum(want.abs(), torch.as_tensor(floor))).max())
        assert err <= 1e-4, f"{name}: max relative error {err:.2e}"
    assert res.fidelity <= RTOL
    assert res.state_fidelity is not None and res.state_fidelity <= 1e-4


CASES = {
    # name: (path, Bn, Tn, cu_seqlens, input options, use_gate_in_kernel)
    "chunk-T70-state": ("chunk", 1, 70, None, dict(h0=True), False),
    "chunk-varlen-gate": ("chunk", 1, 100, [0, 30, 100], dict(h0=True, N=2, gate=True), True),
    "fused-batch-zero-key": ("fused_recurrent", 2, 20, None, dict(zero_key=True, h0=True), False),
    "fused-varlen-b0-gate": ("fused_recurrent", 1, 30, [0, 11, 30], dict(b_range=(0.0, 1e-3), h0=True, N=2,
                                                                        gate=True), True),
    "fused-b1-gva": ("fused_recurrent", 1, 24, None, dict(b_range=(0.999, 1.0), H=1, HV=2), False),
    "fused-b-near-2": ("fused_recurrent", 1, 24, None, dict(b_range=(1.9, 2.0)), False),
}


#: The cases whose record is also replayed by the fused Triton replay kernel (interpreted).
TRITON_REPLAY = ("fused-varlen-b0-gate", "fused-b1-gva")


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_record_replay_matches_fp64_loop(name):
    """Record and replay of one kernel call against the fp64 loop; the capture's reference stand-in
    against the kernel; for :data:`TRITON_REPLAY`, the delta-rule Triton replay too (GDN-2 is
    replayed as recorded, by the delta-rule replays)."""
    path, Bn, Tn, cu, opts, gate = CASES[name]
    args = _inputs(list(CASES).index(name), Bn=Bn, Tn=Tn, **opts)
    fn, kw, out = _call(path, args, cu=cu, gate=gate)
    adapter = GDN2Adapter(path)
    call = adapter.record(kw, out, layer=0, layer_name="gdn2", kernel=fn.__name__, fla=True)
    call.flags.update(kernels="fla", device="cpu")
    assert call.family == "gdn2" and call.flags["path"] == path and set(call.extra) == {"b", "w"}
    hv = args["v"].shape[2]
    ref = _oracle(args, cu, gate, hv)
    _check(out, replay_call(call, backend="torch"), ref, Bn, Tn, hv, cu)
    if name in TRITON_REPLAY:
        _check(out, replay_call(call, backend="triton"), ref, Bn, Tn, hv, cu)
    o_ref, ht_ref = adapter.reference(kw)  # capture's CPU stand-in for the kernel
    assert float((o_ref - out[0]).norm() / out[0].norm()) <= RTOL
    assert float((ht_ref - out[1]).norm() / out[1].norm()) <= RTOL


def test_without_decay_the_post_ratio_is_one_token_closed_form():
    """g = 0: q_t = (1 − ⟨b_t, k̂_t ⊙ k̂_t⟩)² (Lemma 4.1 with d = b), measured by the replay."""
    args = _inputs(5, Bn=1, Tn=24, h0=True)
    args["g"] = torch.zeros_like(args["g"])
    fn, kw, out = _call("fused_recurrent", args)
    call = GDN2Adapter("fused_recurrent").record(kw, out, layer=0, layer_name="gdn2", kernel=fn.__name__, fla=True)
    res = replay_call(call, backend="torch")
    rows = [(0, t, h) for h in range(2) for t in range(24)]
    idx = tuple(torch.tensor(x) for x in zip(*rows))
    k = _l2(args["k"].double())
    a = (args["b"].double() * k * k).sum(-1)[idx]
    assert torch.allclose(res.columns["write_gain"].double(), a, rtol=1e-5, atol=1e-6)
    assert torch.allclose(res.columns["residual_ratio"].double(), (1 - a) ** 2, rtol=1e-4, atol=1e-5)


def test_continuous_batching_is_refused_naming_the_kernel():
    args = _inputs(3, Bn=1, Tn=4)
    kw = dict(args, ssm_state_indices=torch.zeros(1, 1, dtype=torch.long), use_qk_l2norm_in_kernel=True)
    with pytest.raises(ValueError, match="fused_recurrent_gdn2.*ssm_state_indices"):
        GDN2Adapter("fused_recurrent").canonical(kw, fla=False)
