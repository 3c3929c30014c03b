"""fla 0.6.0's RWKV-7 kernels, recorded under capture and replayed, against a loop written here.

The fp64 loop below shares no code with the package: it runs fla's own K×V form of the recurrence,
``h ← exp(w) ⊙ h + b (aᵀh) + k vᵀ`` with ``a = −κ̂``, ``b = κ̂ ⊙ α``, ``o = hᵀ(scale · r)``, and measures
``½‖hᵀx − v‖²`` on the removal key ``x = κ̂`` (the package's loss) and on the write key ``x = k``
(``residual_ratio_alt``). The kernels are called directly, through a stand-in layer whose forward
calls the entry point as ``fla.layers.rwkv7`` imports it (where capture hooks it), on awkward inputs:
several rows with an initial state; packed sequences with initial states; in-context rates α near 0,
near 1 and at 2; decays at 0 and at the layer's lower bound; zero removal and write keys; the chunk
path at T = 70 and packed (fla's fp32 chunk DPLR kernel is only ~3e-5 accurate on its own — it warns
that it does not support fp32 — so its fidelity is checked at 1e-4 there); ``reverse=True`` refused;
a NaN input excludes exactly its stream.
"""

from __future__ import annotations

import math

import pytest
import torch

from osdn_diag.capture.context import capture
from osdn_diag.replay import replay_call
from osdn_diag.replay import families

pytestmark = [pytest.mark.usefixtures("fla_interpreter"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::RuntimeWarning")]

K, V = 8, 6
LOWER = -0.6065306597126334  # the layer's lower bound of w


def _stand_in_layer(kernel: str):
    import fla.layers.rwkv7 as site
    from fla.layers import RWKV7Attention

    class KernelLayer(RWKV7Attention):
        def __init__(self):
            torch.nn.Module.__init__(self)

        def forward(self, **kw):
            return getattr(site, kernel)(**kw)

    return KernelLayer()


def _inputs(gen, B, T, H):
    kk = torch.randn(B, T, H, K, generator=gen)
    kk = kk / kk.norm(dim=-1, keepdim=True)
    return dict(
        r=torch.randn(B, T, H, K, generator=gen), w=LOWER * torch.rand(B, T, H, K, generator=gen),
        k=0.5 * torch.randn(B, T, H, K, generator=gen), v=torch.randn(B, T, H, V, generator=gen),
        kk=kk, alpha=torch.rand(B, T, H, K, generator=gen),
    )


def _kernel_kw(x: dict, path: str, **more) -> dict:
    base = dict(r=x["r"], w=x["w"], k=x["k"], v=x["v"], scale=1.0, **more)
    if path == "chunk":
        return dict(base, a=-x["kk"], b=x["kk"] * x["alpha"], safe_gate=True, lower_bound=LOWER, chunk_size=64)
    return dict(base, kk=x["kk"], a=x["alpha"])


def _loop(x, h0=None, offsets=None, scale=1.0):
    """fp64 in fla's layout; returns o, final h [N, H, K, V], losses on κ̂ and on k ([B, T, H] each)."""
    d = {n: t.double() for n, t in x.items()}
    B, T, H, _ = d["k"].shape
    segs = [(b, 0, T) for b in range(B)] if offsets is None else [(0, s, e) for s, e in zip(offsets[:-1], offsets[1:])]
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    # before, after (κ̂); before, after (k); toward the own target y = (c_k/c_b) v: before, decayed, after;
    # c_k/c_b; c_b
    L = torch.zeros(9, B, T, H, dtype=torch.float64)
    hf = torch.zeros(len(segs), H, K, V, dtype=torch.float64)
    for n, (b, s, e) in enumerate(segs):
        for hd in range(H):
            h = torch.zeros(K, V, dtype=torch.float64) if h0 is None else h0[n, hd].double().clone()
            for t in range(s, e):
                kk, k, v = d["kk"][b, t, hd], d["k"][b, t, hd], d["v"][b, t, hd]
                f = lambda M, key: 0.5 * float(((M.T @ key - v) ** 2).sum())  # noqa: E731
                L[0, b, t, hd], L[2, b, t, hd] = f(h, kk), f(h, k)
                a, bb = -kk, kk * d["alpha"][b, t, hd]
                c_k, c_b = float(k @ kk), float(bb @ kk)
                c = c_k / c_b if c_b != 0 else math.nan
                g = lambda M: 0.5 * float(((M.T @ kk - c * v) ** 2).sum())  # noqa: E731
                L[4, b, t, hd], L[5, b, t, hd] = g(h), g(d["w"][b, t, hd].exp()[:, None] * h)
                L[7, b, t, hd], L[8, b, t, hd] = c, c_b
                h = d["w"][b, t, hd].exp()[:, None] * h + torch.outer(bb, a @ h) + torch.outer(k, v)
                L[1, b, t, hd], L[3, b, t, hd] = f(h, kk), f(h, k)
                L[6, b, t, hd] = g(h)
                o[b, t, hd] = h.T @ (scale * d["r"][b, t, hd])
            hf[n, hd] = h
    return o, hf, L


def _grid(columns, call, name):
    B, T, H = call.beta.shape
    out = torch.full((B, T, H), float("nan"), dtype=torch.float64)
    segs = call.segments()
    for i in range(len(columns["pos"])):
        row, start, _ = segs[int(columns["sequence"][i])]
        out[row, start + int(columns["pos"][i]), int(columns["head"][i])] = float(columns[name][i])
    return out


def _ratio(after, before):
    return torch.where(before == 0, torch.ones_like(before), after / torch.where(before == 0, 1.0, before))


def _run(kernel, kw, kernels="fla"):
    layer = _stand_in_layer(kernel)
    with torch.no_grad(), capture(layer, kernels=kernels) as cap:
        out = layer(**kw)
    assert len(cap.calls) == 1
    return out, cap.calls[0]


def _check(call, x, out, *, h0=None, offsets=None, tolerance=None, rel=1e-5):
    o, hf, (before, after, before_k, after_k, own_b, own_d, own_a, c, _) = _loop(x, h0, offsets)
    res = replay_call(call, tolerance=tolerance, state_tolerance=tolerance)
    cols = res.columns
    scale = before.abs().amax()
    for name, ref in (("loss_before", before), ("loss_after", after)):
        assert float((_grid(cols, call, name) - ref).abs().max() / scale) <= rel, name
    for name, ref in (("residual_ratio", _ratio(after, before)), ("residual_ratio_alt", _ratio(after_k, before_k)),
                      ("own_target_ratio", _ratio(own_a, own_b)), ("own_target_ratio_post", _ratio(own_a, own_d)),
                      ("target_scale", c)):
        got = _grid(cols, call, name)
        # NaN exactly where the own target is undefined (c_b = 0), and nowhere else.
        assert torch.equal(got.isnan(), ref.isnan()), name
        err = ((got - ref).abs() / ref.abs().clamp_min(1e-2)).nan_to_num(nan=0.0)
        assert float(err.max()) <= 10 * rel, name
    rep = families.replays()["rwkv7"](call, dtype=torch.float32, bad=None, backend="torch")
    assert float((rep.o.double() - o).norm() / o.norm()) <= rel
    assert float((rep.final_state.double() - hf.transpose(-1, -2)).norm() / hf.norm()) <= rel
    # The record's β is the erase's gain along κ̂: Σ α κ̂².
    assert torch.allclose(call.beta.double(), (x["alpha"].double() * x["kk"].double() ** 2).sum(-1), atol=1e-6)
    if out is not None and out[1] is not None:
        kernel_tol = 1e-5 if tolerance is None else tolerance
        assert float((out[0].double() - o).norm() / o.norm()) <= kernel_tol
        assert float((out[1].double() - hf).norm() / hf.norm()) <= kernel_tol
    return res


def test_fused_recurrent_rows_initial_state_edge_rates_and_zero_keys():
    gen = torch.Generator().manual_seed(0)
    B, T, H = 2, 23, 2
    x = _inputs(gen, B, T, H)
    x["alpha"][0, :6] = 1e-6       # α near 0: nothing erased
    x["alpha"][0, 6:12] = 1 - 1e-6  # near 1: a full erase along κ̂
    x["alpha"][1, :5, 0] = 2.0     # beyond the layer's sigmoid range: the kernel takes it
    x["w"][0, 12:16] = 0.0         # no decay
    x["w"][1, 10:14] = LOWER       # the layer's strongest decay
    x["kk"][0, 18, 1] = 0.0        # zero removal key: its loss is ½‖v‖² before and after, q = 1
    x["k"][1, 7] = 0.0             # zero write key: nothing written
    h0 = 0.3 * torch.randn(B, H, K, V, generator=gen)
    out, call = _run("fused_mul_recurrent_rwkv7", _kernel_kw(x, "fused_recurrent", initial_state=h0,
                                                            output_final_state=True))
    assert call.family == "rwkv7" and call.flags["path"] == "fused_recurrent" and set(call.extra) == {"b"}
    res = _check(call, x, out, h0=h0)
    assert res.fidelity <= 1e-5 and res.state_fidelity <= 1e-5
    assert _grid(res.columns, call, "residual_ratio")[0, 18, 1] == 1.0
    # A zero removal key erases nothing: no own target there (NaN), and the ratio toward v is 1.
    assert _grid(res.columns, call, "own_target_ratio")[0, 18, 1].isnan()


def test_without_decay_the_own_target_ratio_is_one_minus_the_erase_gain_squared():
    """The derivation behind own_target_ratio: with D = I the update maps S κ̂ − y to
    (1 − c_b)(S κ̂ − y) for y = (c_k/c_b) v, whatever c_k; toward v itself it does not contract so."""
    gen = torch.Generator().manual_seed(7)
    x = _inputs(gen, 1, 20, 2)
    x["w"].zero_()
    _, call = _run("fused_mul_recurrent_rwkv7", _kernel_kw(x, "fused_recurrent"))
    res = replay_call(call)
    c_b = (x["alpha"].double() * x["kk"].double() ** 2).sum(-1)
    got = _grid(res.columns, call, "own_target_ratio")
    assert float((got[:, 1:] - (1 - c_b[:, 1:]) ** 2).abs().max()) <= 1e-5  # token 0: empty state, loss ½‖y‖²
    assert float((_grid(res.columns, call, "residual_ratio")[:, 1:] - (1 - c_b[:, 1:]) ** 2).abs().max()) > 1e-2


def test_fused_recurrent_packed_sequences_with_initial_states():
    gen = torch.Generator().manual_seed(1)
    x = _inputs(gen, 1, 31, 2)
    offsets = [0, 9, 31]
    h0 = 0.3 * torch.randn(2, 2, K, V, generator=gen)
    kw = _kernel_kw(x, "fused_recurrent", initial_state=h0, output_final_state=True,
                    cu_seqlens=torch.tensor(offsets))
    out, call = _run("fused_mul_recurrent_rwkv7", kw)
    assert call.segments() == [(0, 0, 9), (0, 9, 31)]
    _check(call, x, out, h0=h0, offsets=offsets)
    # The reference stand-in computes the same.
    out_ref, call_ref = _run("fused_mul_recurrent_rwkv7", kw, kernels="reference")
    _check(call_ref, x, out_ref, h0=h0, offsets=offsets)


@pytest.mark.parametrize("packed", [False, True])
def test_chunk_path(packed):
    gen = torch.Generator().manual_seed(2)
    offsets = [0, 45, 70] if packed else None
    x = _inputs(gen, 1, 70, 2)
    h0 = 0.3 * torch.randn(2 if packed else 1, 2, K, V, generator=gen)
    kw = _kernel_kw(x, "chunk", initial_state=h0, output_final_state=True,
                    cu_seqlens=None if offsets is None else torch.tensor(offsets))
    out, call = _run("chunk_rwkv7", kw)
    assert call.flags["path"] == "chunk" and call.flags["chunk_size"] == 64
    assert torch.equal(call.k, -kw["a"]) and torch.equal(call.extra["b"], kw["b"])
    res = _check(call, x, out, h0=h0, offsets=offsets, tolerance=1e-4)
    assert res.fidelity <= 1e-4


def test_reverse_is_refused_and_a_nonfinite_input_excludes_its_stream():
    gen = torch.Generator().manual_seed(3)
    x = _inputs(gen, 2, 12, 2)
    with pytest.raises(NotImplementedError, match="reverse"):
        _run("fused_mul_recurrent_rwkv7", _kernel_kw(x, "fused_recurrent", reverse=True))
    x["w"][1, 4, 0, 3] = float("nan")
    _, call = _run("fused_mul_recurrent_rwkv7", _kernel_kw(x, "fused_recurrent"))
    res = replay_call(call)
    assert res.nonfinite == 1 and res.nonfinite_streams == [(1, 0)]
    assert not math.isnan(float(res.columns["residual_ratio_alt"][res.columns["finite"]].max()))
