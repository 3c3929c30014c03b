"""fla 0.6.0's Comba kernels (``chunk_comba``, ``fused_recurrent_comba``) recorded and replayed.

The oracle is a plain fp64 loop written here (:func:`_loop`), sharing nothing with the package: it
runs Comba as fla's Triton kernels do — the residual against the state *before* the token's decay,
``u_t = v_t − S_{t−1} p_t``, then ``S_t = α_t S_{t−1} + β_t u_t k_tᵀ`` — on q, k, p normalised the way
the kernels normalise them. It must reproduce the kernels' outputs and final states (so it is the
recurrence they ran; a decay-first loop, as in fla's ``naive_recurrent_comba``, does not, which
:func:`test_the_kernels_take_the_residual_before_the_decay` checks), and then every token's
``loss_before``, ``loss_after``, ``loss_before_decayed``, the ratios and ``residual_ratio_alt`` of the
package's replay of the record.

Awkward inputs: T = 70 on the chunk path (off the 64-token grid), packed sequences, an initial state,
β near 0, near 1 and 2, zero keys, and p ≠ k without the in-kernel l2 norm (the Comba layer's own
call, with it, is exercised end to end in tests/pipeline/test_family_comba_e2e.py). fp32 under
Triton's interpreter (its bf16 ``tl.dot`` is wrong), tiny shapes (H = 2, K = 16, V = 8).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from osdn_diag.capture.families.comba import CombaAdapter
from osdn_diag.replay import replay_call

pytestmark = pytest.mark.usefixtures("fla_interpreter")

H, K, V = 2, 16, 8  # K ≠ V: a transposed state cannot pass
RTOL = 1e-5


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _loop(q, p, k, v, beta, g, h0, bounds, scale, *, decay_first=False):
    """fp64 Comba over packed segments ``bounds`` (list of (row, start, end)); state ``[V, K]``.
    Returns o, final ``[N, H, V, K]`` and per-token losses (dict of ``[B, T, H]``)."""
    Bn, Tn = k.shape[:2]
    q, p, k, v, beta, g = (x.double() for x in (q, p, k, v, beta, g))
    o = torch.zeros(Bn, Tn, H, V, dtype=torch.float64)
    cols = {n: torch.zeros(Bn, Tn, H, dtype=torch.float64)
            for n in ("before", "after", "before_dec", "alt_before", "alt_after")}
    finals = torch.zeros(len(bounds), H, V, K, dtype=torch.float64)
    for n, (b, s, e) in enumerate(bounds):
        for h in range(H):
            S = torch.zeros(V, K, dtype=torch.float64) if h0 is None else h0[n, h].double().clone()
            for t in range(s, e):
                pt, kt, vt = p[b, t, h], k[b, t, h], v[b, t, h]
                alpha = float(torch.exp(g[b, t, h]))
                if decay_first:
                    S = alpha * S
                u = vt - S @ pt
                cols["before"][b, t, h] = 0.5 * (u @ u)
                cols["alt_before"][b, t, h] = 0.5 * ((S @ kt - vt) ** 2).sum()
                if not decay_first:
                    S = alpha * S
                cols["before_dec"][b, t, h] = 0.5 * ((S @ pt - vt) ** 2).sum()
                S = S + float(beta[b, t, h]) * torch.outer(u, kt)
                cols["after"][b, t, h] = 0.5 * ((S @ pt - vt) ** 2).sum()
                cols["alt_after"][b, t, h] = 0.5 * ((S @ kt - vt) ** 2).sum()
                o[b, t, h] = S @ (scale * q[b, t, h])
            finals[n, h] = S
    return o, finals, cols


def _ratio(after, before):
    return torch.where(before == 0, torch.ones_like(after), after / torch.where(before == 0, 1.0, before))


def _inputs(seed, *, Bn, Tn, beta_range=(0.0, 1.0), zero_keys=False, h0=False, N=None, same_p=False,
            unit=False):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(Bn, Tn, H, K, generator=gen), torch.randn(Bn, Tn, H, K, generator=gen)
    p = k * torch.sigmoid(torch.randn(H, generator=gen))[None, None, :, None] if same_p else \
        torch.randn(Bn, Tn, H, K, generator=gen)
    if unit:  # unit keys given to a kernel that does not normalise: β up to 2 keeps the state bounded
        k, p = torch.nn.functional.normalize(k, dim=-1), torch.nn.functional.normalize(p, dim=-1)
    v = torch.randn(Bn, Tn, H, V, generator=gen)
    lo, hi = beta_range
    beta = lo + (hi - lo) * torch.rand(Bn, Tn, H, generator=gen)
    g = -0.3 * torch.rand(Bn, Tn, H, generator=gen)  # log decay, α ∈ (0.74, 1]
    if zero_keys:  # a few tokens with both keys zero (and one with only p zero)
        k[:, 3] = 0.0
        p[:, 3] = 0.0
        p[:, 5] = 0.0
    init = 0.3 * torch.randn(N or Bn, H, K, V, generator=gen) if h0 else None  # fla's K×V layout
    return dict(q=q, k=k, v=v, p=p, g=g, beta=beta, initial_state=init)


def _bounds(Bn, Tn, cu):
    return [(b, 0, Tn) for b in range(Bn)] if cu is None else [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]


def _run(path, args, *, l2norm, cu=None):
    """fla's kernel on ``args``, its record and replay, and the fp64 oracle of the same inputs."""
    from fla.ops.comba import chunk_comba, fused_recurrent_comba

    fn = chunk_comba if path == "chunk" else fused_recurrent_comba
    kw = dict(args, output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
              cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.long))
    bound = inspect.signature(fn).bind(**kw)
    bound.apply_defaults()
    kw = dict(bound.arguments)
    out = fn(**kw)
    adapter = CombaAdapter(path)
    call = adapter.record(kw, out, layer=0, layer_name="comba", kernel=fn.__name__, fla=True)
    call.flags.update(kernels="fla", device="cpu")
    res = replay_call(call, backend="torch")
    q, k, p = args["q"], args["k"], args["p"]
    if l2norm:
        q, k, p = _l2(q.double()), _l2(k.double()), _l2(p.double())
    h0 = args["initial_state"]
    h0 = None if h0 is None else h0.transpose(-1, -2)
    Bn, Tn = k.shape[:2]
    ref = _loop(q, p, k, args["v"], args["beta"], args["g"], h0, _bounds(Bn, Tn, cu), K**-0.5)
    return out, call, res, ref


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _check(out, res, ref, Bn, Tn, cu):
    o_ref, final_ref, cols = ref
    o, ht = out
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert _rel(o, o_ref) <= RTOL, "the fp64 loop is not the recurrence the kernel ran (output)"
    assert _rel(ht.transpose(-1, -2), final_ref) <= RTOL, "... (final state)"
    # The replay's per-token table in (sequence, head, position) order.
    rows = [(b, t, h) for b, s, e in _bounds(Bn, Tn, cu) for h in range(H) for t in range(s, e)]
    idx = tuple(torch.tensor(x) for x in zip(*rows))
    expect = {
        "loss_before": cols["before"][idx], "loss_after": cols["after"][idx],
        "loss_before_decayed": cols["before_dec"][idx],
        "residual_ratio": _ratio(cols["after"], cols["before"])[idx],
        "residual_ratio_post": _ratio(cols["after"], cols["before_dec"])[idx],
        "residual_ratio_alt": _ratio(cols["alt_after"], cols["alt_before"])[idx],
    }
    for name, want in expect.items():
        got = res.columns[name].double()
        assert torch.isfinite(got).all(), name
        # Ratios relative to max(|x|, 1e-3): a ratio of tiny losses is rounding-limited.
        floor = 1e-3 if "ratio" in name else 1e-6 * float(want.abs().max())
        err = float(((got - want).abs() / want.abs().clamp_min(floor)).max())
        assert err <= 1e-4, f"{name}: max relative error {err:.2e}"
    assert res.fidelity <= RTOL
    assert res.state_fidelity is not None and res.state_fidelity <= 1e-4


CASES = {
    # name: (path, Bn, Tn, cu_seqlens, input options, l2norm)
    "chunk-T70-state": ("chunk", 1, 70, None, dict(h0=True), True),
    "chunk-varlen-state": ("chunk", 1, 100, [0, 30, 100], dict(h0=True, N=2), True),
    "chunk-beta2-p-free": ("chunk", 1, 70, None, dict(beta_range=(1.9, 2.0), unit=True), False),
    "fused-batch-zero-keys": ("fused_recurrent", 2, 20, None, dict(zero_keys=True, h0=True), True),
    "fused-varlen-beta0": ("fused_recurrent", 1, 30, [0, 11, 30], dict(beta_range=(0.0, 1e-3), h0=True, N=2), True),
    "fused-beta1-p-free": ("fused_recurrent", 1, 24, None, dict(beta_range=(0.999, 1.0), unit=True), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_record_replay_matches_fp64_loop(name):
    path, Bn, Tn, cu, opts, l2norm = CASES[name]
    args = _inputs(list(CASES).index(name), Bn=Bn, Tn=Tn, **opts)
    out, call, res, ref = _run(path, args, l2norm=l2norm, cu=cu)
    assert call.family == "comba" and call.flags["path"] == path
    assert call.write_key is not None and not torch.equal(call.write_key, call.k)
    _check(out, res, ref, Bn, Tn, cu)


def test_the_record_holds_p_as_read_key_and_k_as_write_key():
    args = _inputs(7, Bn=1, Tn=10)
    _, call, _, _ = _run("fused_recurrent", args, l2norm=True)
    assert torch.allclose(call.k, _l2(args["p"]), atol=1e-6)
    assert torch.allclose(call.write_key, _l2(args["k"]), atol=1e-6)
    assert call.initial_state is None


def test_the_kernels_take_the_residual_before_the_decay():
    """Both kernels against the decay-first order of fla's naive reference: they do not run it."""
    for path, Tn in (("fused_recurrent", 20), ("chunk", 70)):
        args = _inputs(11, Bn=1, Tn=Tn, h0=True)
        args["g"] = -1.0 + 0 * args["g"]  # a strong decay: the two orders differ clearly
        out, _, _, ref = _run(path, args, l2norm=True)
        q, k, p = (_l2(args[n].double()) for n in ("q", "k", "p"))
        naive = _loop(q, p, k, args["v"], args["beta"], args["g"], args["initial_state"].transpose(-1, -2),
                      _bounds(1, Tn, None), K**-0.5, decay_first=True)
        assert _rel(out[0], ref[0]) <= RTOL
        assert _rel(out[0], naive[0]) > 1e-2


def test_without_decay_the_ratio_is_one_token_closed_form():
    """g = 0: q_t = (1 − β_t⟨k_t, p_t⟩)² per token (the family's Lemma 4.1), measured by the replay."""
    args = _inputs(5, Bn=1, Tn=24, h0=True)
    args["g"] = torch.zeros_like(args["g"])
    _, call, res, _ = _run("fused_recurrent", args, l2norm=True)
    rows = [(0, t, h) for h in range(H) for t in range(24)]
    idx = tuple(torch.tensor(x) for x in zip(*rows))
    k, p = _l2(args["k"].double()), _l2(args["p"].double())
    a = (args["beta"].double() * (k * p).sum(-1))[idx]
    assert torch.allclose(res.columns["write_gain"].double(), a, rtol=1e-5, atol=1e-6)
    assert torch.allclose(res.columns["residual_ratio"].double(), (1 - a) ** 2, rtol=1e-4, atol=1e-5)


def test_a_nonfinite_p_excludes_its_stream():
    args = _inputs(3, Bn=2, Tn=12)
    out, call, _, _ = _run("fused_recurrent", args, l2norm=False)
    call.k[1, 4, 0] = float("nan")
    call.o[1, 4:, 0] = float("nan")
    res = replay_call(call, backend="torch", state_tolerance=float("inf"))
    assert res.nonfinite == 1 and res.nonfinite_streams == [(1, 0)]


def test_the_reference_stand_in_returns_the_kernels_outputs():
    """``CombaAdapter.reference`` (capture's CPU stand-in) against fla's kernels, both paths."""
    from fla.ops.comba import chunk_comba, fused_recurrent_comba

    for path, fn, Tn in (("chunk", chunk_comba, 70), ("fused_recurrent", fused_recurrent_comba, 20)):
        args = _inputs(13, Bn=1, Tn=Tn, h0=True)
        kw = dict(args, output_final_state=True, use_qk_l2norm_in_kernel=True, scale=None, cu_seqlens=None)
        o, ht = fn(**kw)
        o_ref, ht_ref = CombaAdapter(path).reference(kw)
        assert _rel(o_ref, o) <= RTOL and _rel(ht_ref, ht) <= RTOL


def test_the_layers_p_is_a_shrunk_copy_of_k_after_the_normalisation():
    """fla's layer passes p = k·sigmoid(decay); l2norm's ε (x / √(‖x‖² + 1e-6)) then gives
    p̂ = c·k̂ with c = σ·√(‖k‖² + ε) / √(σ²‖k‖² + ε), well below 1 where σ²‖k‖² is not large against ε
    (inner decay −4, keys of the tiny preset's size). The record keeps the two keys apart and the two
    losses then give different ratios, each matching the fp64 loop."""
    args = _inputs(11, Bn=1, Tn=24)
    sig = torch.sigmoid(torch.tensor(-4.0))
    args["k"] = 0.02 * args["k"] / args["k"].norm(dim=-1, keepdim=True)  # ‖k‖² = 4e-4 on every token
    args["p"] = args["k"] * sig
    out, call, res, ref = _run("fused_recurrent", args, l2norm=True)
    _check(out, res, ref, 1, 24, None)
    k2 = args["k"].double().square().sum(-1)
    s = float(sig)
    c = s * torch.sqrt(k2 + 1e-6) / torch.sqrt(s * s * k2 + 1e-6)
    assert float(c.max()) < 0.4
    assert torch.allclose(call.k.double(), c[..., None] * call.write_key.double(), atol=1e-6)
    q, q_alt = res.columns["residual_ratio"], res.columns["residual_ratio_alt"]
    assert float((q - q_alt).abs().max()) > 0.1
