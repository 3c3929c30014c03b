"""GatedDeltaProduct (family ``gated_delta_product``): fla's own kernels recorded and replayed, checked
against an fp64 loop written here that shares no code with the package.

fla 0.6.0 runs under Triton's interpreter in fp32 (its bf16 ``tl.dot`` is wrong on the CPU).
``chunk_gated_delta_product`` refuses fp32 inputs in its public wrapper (the autograd function it
calls does not), so the chunk cases call that function through :func:`chunk_fp32`, a wrapper with the
public signature, and the layer cases put it in the layer module's place.

Cases: the chunk path on packed sequences of 45 and 25 tokens (T·n = 140 micro-steps, not a multiple
of 64), an initial state, two and three micro-steps per token, with and without the gate; β near 0,
near 1 and near 2 (``allow_neg_eigval``) and zero keys on some micro-steps; the fused recurrent
kernel as the layer calls it (interleaved, ``cu_seqlens · n``); and a ``GatedDeltaProduct`` layer's
forward on both paths under ``capture``; a token whose pairs are all zero. Every row of the per-token
table — one per (token, micro-step) with ``pos`` the token — is compared with the loop:
``loss_before``, ``loss_after``, ``residual_ratio``, ``residual_ratio_post``, ``step``; the token's
loss ``L_t = Σ_j ½‖S k_j − v_j‖²`` before its gate, after it and after its last micro-step
(``token_loss_*``), its ratios ``token_ratio``, ``token_ratio_post`` (one loss, after over before),
and the products of the micro-step ratios (``micro_step_ratio_product``, ``_post``); the summary's
per-token q_geo with the token ratios'; the replayed output and final state with the loop's and the
kernel's. Both replays — the family's torch reference and the Triton replay on the probed record —
are checked against the loop, and against each other, on the packed cases.
"""

from __future__ import annotations

import math

import pytest
import torch

from osdn_diag.capture.families.gated_deltaproduct import GDPChunkAdapter, GDPFusedAdapter
from osdn_diag.capture.store import StoredCall
from osdn_diag.replay import replay_call
from osdn_diag.replay.replayer import Replayer

pytestmark = pytest.mark.usefixtures("fla_interpreter")

RTOL = 1e-5


def chunk_fp32(q, k, v, g, beta, num_householder, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None):
    """fla's ``chunk_gated_delta_product`` without the wrapper's refusal of fp32 inputs."""
    from fla.ops.gated_delta_product.chunk import ChunkGatedDeltaProductFunction

    if scale is None:
        scale = k.shape[-1] ** -0.5
    return ChunkGatedDeltaProductFunction.apply(
        q, k, v, g, beta, scale, num_householder, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu, cp_context,
    )


# ---------------------------------------------------------------------------------------------
# The fp64 loop: token form (q, g per token; k, v, β per micro-step, row t·n + j), K×V initial
# state as fla takes it. Normalises q and k as fla's kernels do: x / sqrt(Σx² + 1e-6).
# ---------------------------------------------------------------------------------------------
def _unit(x):
    x = x.double()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _pairs_loss(S, pairs):
    """A token's loss Σ_j ½‖S k_j − v_j‖² over its (k_j, v_j) pairs, as a float."""
    return sum(0.5 * float(((S @ kk - vv) ** 2).sum()) for kk, vv in pairs)


def loop64(q, k, v, beta, g, n, h0_kv=None, cu=None, scale=None, normalise=True):
    """Returns o [B,T,H,V], final [N,H,V,K], per micro-step row [B,T·n,H]: before (pre-decay),
    decayed (post-decay, = before at j > 0), after; and the token's loss L_t(S) = Σ_j ½‖S k_j − v_j‖²
    over its n pairs, [B,T,H], in a dict: "before" at S_{t−1} (before the gate), "decayed" at
    α_t S_{t−1}, "after" at S_t (after the last micro-step); all fp64. ``normalise=False``: q and k
    are taken as they are (the record's, already what the kernel read)."""
    q, k = (_unit(q), _unit(k)) if normalise else (q.double(), k.double())
    v, beta = v.double(), beta.double()
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    segs = [(b, 0, T, b) for b in range(B)] if cu is None else [
        (0, int(s), int(e), i) for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))]
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    before = torch.zeros(B, T * n, H, dtype=torch.float64)
    decayed, after = before.clone(), before.clone()
    tok = {name: torch.zeros(B, T, H, dtype=torch.float64) for name in ("before", "decayed", "after")}
    final = torch.zeros(len(segs), H, V, K, dtype=torch.float64)
    for b, s, e, i in segs:
        for h in range(H):
            S = torch.zeros(V, K, dtype=torch.float64) if h0_kv is None else h0_kv[i, h].double().T.clone()
            for t in range(s, e):
                pairs = [(k[b, t * n + j, h], v[b, t * n + j, h]) for j in range(n)]
                alpha = 1.0 if g is None else math.exp(float(g[b, t, h]))
                tok["before"][b, t, h] = _pairs_loss(S, pairs)
                tok["decayed"][b, t, h] = _pairs_loss(alpha * S, pairs)
                for j in range(n):
                    r = t * n + j
                    kk, vv = k[b, r, h], v[b, r, h]
                    before[b, r, h] = 0.5 * float(((S @ kk - vv) ** 2).sum())
                    if j == 0 and g is not None:
                        S = S * math.exp(float(g[b, t, h]))
                    decayed[b, r, h] = 0.5 * float(((S @ kk - vv) ** 2).sum())
                    S = S + float(beta[b, r, h]) * torch.outer(vv - S @ kk, kk)
                    after[b, r, h] = 0.5 * float(((S @ kk - vv) ** 2).sum())
                tok["after"][b, t, h] = _pairs_loss(S, pairs)
                o[b, t, h] = S @ (scale * q[b, t, h])
            final[i, h] = S
    return o, final, before, decayed, after, tok


def check_record(call, n, q, k, v, beta, g, h0_kv=None):
    """The record is the interleaved form of what the kernel read: unit q on the last micro-step, the
    gate on micro-step 0, fla's normalised keys, v and β as given, the initial state V×K."""
    B, T = q.shape[:2]
    qr = call.q.reshape(B, T, n, *call.q.shape[2:])
    assert torch.equal(qr[:, :, :-1], torch.zeros_like(qr[:, :, :-1]))
    assert torch.allclose(qr[:, :, -1].double(), _unit(q), rtol=0, atol=1e-6)
    assert torch.allclose(call.k.double(), _unit(k), rtol=0, atol=1e-6)
    assert torch.equal(call.v, v.float()) and torch.equal(call.beta, beta.float())
    if g is None:
        assert call.g is None
    else:
        gr = call.g.reshape(B, T, n, -1)
        assert torch.equal(gr[:, :, 0], g.float()) and not gr[:, :, 1:].any()
    if h0_kv is not None:
        assert torch.equal(call.initial_state, h0_kv.float().transpose(-1, -2))


def _q(a, b):
    return 1.0 if b == 0 else a / b


def _close(x, y, what, floor, rtol=RTOL):
    """``|x − y| ≤ rtol · max(|y|, floor)``: relative, except below ``floor``, where fp32 cannot
    resolve a value relatively (a write with β ≈ 1 leaves a loss ~1e-8 of the one before it)."""
    assert math.isfinite(x), what  # NaN never passes
    assert abs(x - y) <= rtol * max(abs(y), floor), f"{what}: {x} vs {y}"


def _geo(xs):
    """The summary's geometric mean: exp(mean(log max(x, 1e-30)))."""
    return math.exp(sum(math.log(max(x, 1e-30)) for x in xs) / len(xs))


def check_table(call, n, gated, backends=("torch", "triton")):
    """Replay ``call`` into the per-token table with each backend and compare every row with the fp64
    loop run on the record's tensors (token form of q and g); the backends' tables row by row."""
    segs = call.segments()
    B, Tn, H = call.beta.shape
    qt = call.q.reshape(B, Tn // n, n, *call.q.shape[2:])[:, :, -1]
    gt = None if call.g is None else call.g.reshape(B, Tn // n, n, -1)[:, :, 0]
    h0 = None if call.initial_state is None else call.initial_state.transpose(-1, -2)
    cu = None if call.cu_seqlens is None else call.cu_seqlens // n
    o64, final64, before, decayed, after, tok64 = loop64(qt, call.k, call.v, call.beta, gt, n, h0, cu,
                                                         scale=call.scale, normalise=False)
    prompts = {i: {"task": "t", "length": (e - s) // n} for i, (_, s, e) in enumerate(segs)}
    tables = {}
    for backend in backends:
        rp = Replayer(prompts, backend=backend, device="cpu", comparator=True, retained=backend == "torch")
        table = rp.add(StoredCall(batch=0, prompts=list(prompts), call=call))
        assert table.schema.field("step").type.bit_width == 32
        rows = table.to_pylist()
        _check_rows(rows, call, n, gated, segs, prompts, before, decayed, after, tok64)
        tables[backend] = rows
        s = rp.summary()
        assert s["n"] == len(rows)
        # q_geo is over the micro-step rows: its n-th power is the geometric mean of the products of
        # the micro-step ratios; the per-token q_geo is that of the token's own ratio.
        first = [row for row in rows if row["step"] == 0]
        assert math.isclose(s["q_geo"] ** n, _geo([r["micro_step_ratio_product"] for r in first]), rel_tol=1e-4)
        assert s["n_tokens"] == len(first)
        assert math.isclose(s["q_geo_per_token"], _geo([r["token_ratio"] for r in first]), rel_tol=1e-5)
        assert math.isclose(s["by_family"]["gated_delta_product"]["q_geo_per_token"], s["q_geo_per_token"],
                            rel_tol=1e-12)
        if gated:
            assert math.isclose(s["post_decay"]["q_geo_per_token"], _geo([r["token_ratio_post"] for r in first]),
                                rel_tol=1e-5)
    # The two replays, row by row (the same row order): every per-token column within RTOL.
    if len(tables) == 2:
        a, b = tables.values()
        for ra, rb in zip(a, b, strict=True):
            assert (ra["prompt"], ra["head"], ra["pos"], ra["step"]) == (rb["prompt"], rb["head"], rb["pos"], rb["step"])
            for name in TOKEN_COLUMNS:
                if ra[name] is None:
                    assert rb[name] is None, name
                else:
                    _close(rb[name], ra[name], f"{name} triton vs torch", 1e-3 if "ratio" in name else 1e-6)
    rows = tables[backends[0]]
    # Output (at each token's last micro-step) and final state, replayed against the loop.
    res = replay_call(call, dtype=torch.float64)
    o_rec = call.o.reshape(call.o.shape[0], -1, n, *call.o.shape[2:])
    assert torch.equal(o_rec[:, :, :-1], torch.zeros_like(o_rec[:, :, :-1]))
    assert torch.allclose(o_rec[:, :, -1].double(), o64, rtol=1e-4, atol=1e-5)
    assert res.fidelity < 1e-5 and res.state_fidelity is not None and res.state_fidelity < 1e-5
    assert torch.allclose(call.final_state.double(), final64, rtol=1e-4, atol=1e-5)
    return rows, s


#: The family's per-token columns (docs/run-directory.md, "Families with several writes per token").
TOKEN_COLUMNS = ("token_ratio", "token_ratio_post", "micro_step_ratio_product", "micro_step_ratio_product_post",
                 "token_loss_before", "token_loss_before_decayed", "token_loss_after")


def _check_rows(rows, call, n, gated, segs, prompts, before, decayed, after, tok64):
    H = call.num_heads
    assert len(rows) == sum(e - s for _, s, e in segs) * H
    tok_start = [s // n for _, s, _ in segs]
    rows_b = [r for r, _, _ in segs]
    seen = set()
    for row in rows:
        p, h, t, j = row["prompt"], row["head"], row["pos"], row["step"]
        assert 0 <= j < n and 0 <= t < prompts[p]["length"]
        seen.add((p, h, t, j))
        b, tt = rows_b[p], tok_start[p] + t
        r = tt * n + j
        fb, fa, fd = float(before[b, r, h]), float(after[b, r, h]), float(decayed[b, r, h])
        vv = 0.5 * float(call.v[b, r, h].double().square().sum())
        _close(row["loss_before"], fb, f"loss_before {p, h, t, j}", 1e-3 * vv)
        _close(row["loss_after"], fa, f"loss_after {p, h, t, j}", 1e-3 * fb)
        _close(row["residual_ratio"], _q(fa, fb), f"residual_ratio {p, h, t, j}", 1e-3)
        _close(row["rel_pos"], t / prompts[p]["length"], "rel_pos", 0.0)
        # The token's loss L_t at its three states, and its ratio: one loss, after over before.
        Lb, Ld, La = (float(tok64[name][b, tt, h]) for name in ("before", "decayed", "after"))
        steps = range(tt * n, tt * n + n)
        vt = 0.5 * sum(float(call.v[b, i, h].double().square().sum()) for i in steps)
        _close(row["token_loss_before"], Lb, f"token_loss_before {p, h, t}", 1e-3 * vt)
        _close(row["token_loss_after"], La, f"token_loss_after {p, h, t}", 1e-3 * Lb)
        _close(row["token_ratio"], _q(La, Lb), f"token_ratio {p, h, t}", 1e-3)
        # A product of n ratios, each within RTOL of fp64: within n·RTOL.
        prod = math.prod(_q(float(after[b, i, h]), float(before[b, i, h])) for i in steps)
        _close(row["micro_step_ratio_product"], prod, f"micro_step_ratio_product {p, h, t}", 1e-3, n * RTOL)
        if gated:
            _close(row["residual_ratio_post"], _q(fa, fd), f"residual_ratio_post {p, h, t, j}", 1e-3)
            _close(row["token_loss_before_decayed"], Ld, f"token_loss_before_decayed {p, h, t}", 1e-3 * vt)
            _close(row["token_ratio_post"], _q(La, Ld), f"token_ratio_post {p, h, t}", 1e-3)
            prod_post = math.prod(_q(float(after[b, i, h]), float(decayed[b, i, h])) for i in steps)
            _close(row["micro_step_ratio_product_post"], prod_post, f"micro_step_ratio_product_post {p, h, t}",
                   1e-3, n * RTOL)
        else:
            assert Ld == Lb
            for name in ("token_ratio_post", "residual_ratio_post", "micro_step_ratio_product_post",
                         "token_loss_before_decayed"):
                assert row[name] is None, name
    assert len(seen) == len(rows)  # one row per (prompt, head, token, micro-step)


def _inputs(gen, B, T, n, H, K, V, *, gated, zero_token=True):
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T * n, H, K, generator=gen)
    v = torch.randn(B, T * n, H, V, generator=gen)
    beta = 2 * torch.rand(B, T * n, H, generator=gen)
    # Awkward writes: β near 0, near 1 and near 2 (allow_neg_eigval), and zero keys.
    beta[:, 1::7] = 1e-4
    beta[:, 2::7] = 1.0 - 1e-4
    beta[:, 3::7] = 2.0 - 1e-4
    k[:, 5::11] = 0.0
    if zero_token:  # token 4's every pair is zero (keys and values): its loss is 0 before and after, ratio 1
        k[:, 4 * n:5 * n] = 0.0
        v[:, 4 * n:5 * n] = 0.0
    g = -torch.rand(B, T, H, generator=gen) if gated else None
    return q, k, v, beta, g


@pytest.mark.parametrize("n,gated", [(2, True), (3, False)])
def test_chunk_kernel_varlen_with_initial_state(n, gated):
    gen = torch.Generator().manual_seed(n)
    H, K, V = 2, 16, 8
    cu = torch.tensor([0, 45, 70])
    q, k, v, beta, g = _inputs(gen, 1, 70, n, H, K, V, gated=gated)
    h0 = torch.randn(2, H, K, V, generator=gen)  # fla's K×V layout
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, num_householder=n, scale=None, initial_state=h0,
              output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    out = chunk_fp32(**kw)
    call = GDPChunkAdapter().record(kw, out, layer=0, layer_name="gdp", kernel="chunk_gated_delta_product",
                                    fla=True)
    call.flags.update(kernels="fla", device="cpu")
    assert call.flags["micro_steps"] == n and call.k.shape[1] == 70 * n
    assert torch.equal(call.cu_seqlens, cu * n)
    o64, final64, *_ = loop64(q, k, v, beta, g, n, h0, cu)
    assert torch.allclose(out[0].double(), o64, rtol=1e-4, atol=1e-4)  # the kernel runs the loop's recurrence
    assert torch.allclose(out[1].double().transpose(-1, -2), final64, rtol=1e-4, atol=1e-4)
    check_record(call, n, q, k, v, beta, g, h0)
    check_table(call, n, gated)


def test_chunk_kernel_zero_keys_and_reference_stand_in():
    """B = 2 without packing; the stand-in (reference) returns what the kernel returns."""
    gen = torch.Generator().manual_seed(7)
    n, H, K, V = 2, 2, 16, 16
    q, k, v, beta, g = _inputs(gen, 2, 67, n, H, K, V, gated=True)
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, num_householder=n, scale=None, initial_state=None,
              output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=None)
    out = chunk_fp32(**kw)
    ref = GDPChunkAdapter().reference(kw)
    assert torch.allclose(ref[0], out[0], rtol=1e-4, atol=1e-5)
    assert torch.allclose(ref[1], out[1], rtol=1e-4, atol=1e-5)
    call = GDPChunkAdapter().record(kw, out, layer=0, layer_name="gdp", kernel="chunk_gated_delta_product",
                                    fla=True)
    call.flags.update(kernels="fla", device="cpu")
    check_record(call, n, q, k, v, beta, g)
    rows, _ = check_table(call, n, True, backends=("torch",))  # the triton replay: the varlen cases
    zero_rows = [r for r in rows if float(k[r["prompt"], r["pos"] * n + r["step"], r["head"]].abs().sum()) == 0]
    assert zero_rows and all(r["residual_ratio"] == 1.0 for r in zero_rows)
    assert all(r["token_ratio"] == 1.0 and r["token_loss_before"] == 0.0 for r in rows if r["pos"] == 4)


def _record_fused(layer, kw, out):
    self = layer  # noqa: F841 - the adapter finds the calling GatedDeltaProduct on the stack, as in its forward
    return GDPFusedAdapter().record(kw, out, layer=0, layer_name="gdp", kernel="fused_recurrent_gated_delta_rule",
                                    fla=True)


def test_fused_kernel_as_the_layer_calls_it():
    from fla.layers.gated_deltaproduct import GatedDeltaProduct
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(3)
    n, H, K, V = 2, 2, 16, 16
    cu = torch.tensor([0, 13, 30])
    q, k, v, beta, g = _inputs(gen, 1, 30, n, H, K, V, gated=True)
    h0 = torch.randn(2, H, K, V, generator=gen)
    qi = torch.zeros(1, 30, n, H, K)
    qi[:, :, -1] = q
    gi = torch.zeros(1, 30, n, H)
    gi[:, :, 0] = g
    kw = dict(q=qi.reshape(1, 30 * n, H, K), k=k, v=v, g=gi.reshape(1, 30 * n, H), beta=beta, scale=None,
              initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu * n)
    out = fused_recurrent_gated_delta_rule(**kw)
    layer = GatedDeltaProduct(hidden_size=32, head_dim=K, num_heads=H, num_householder=n)
    call = _record_fused(layer, kw, out)
    call.flags.update(kernels="fla", device="cpu")
    assert call.flags["micro_steps"] == n and call.flags["qk_read_as"] == "float32"
    o64, *_ = loop64(q, k, v, beta, g, n, h0, cu)
    o_last = out[0].reshape(1, 30, n, H, V)[:, :, -1]
    assert torch.allclose(o_last.double(), o64, rtol=1e-4, atol=1e-4)  # the layer's output
    check_record(call, n, q, k, v, beta, g, h0)
    check_table(call, n, True)


def test_fused_adapter_refuses_a_call_outside_the_layer():
    with pytest.raises(RuntimeError, match="outside a GatedDeltaProduct"):
        from osdn_diag.capture.families.gated_deltaproduct import calling_layer_micro_steps

        calling_layer_micro_steps()


# At most 64 tokens: the fused recurrent path (the chunk path's layer forward runs end to end in
# tests/pipeline/test_family_gated_deltaproduct_e2e.py).
@pytest.mark.parametrize("T", [20])
def test_layer_forward_under_capture(T, monkeypatch):
    import fla.layers.gated_deltaproduct as gdp_mod

    from osdn_diag.capture.context import capture

    monkeypatch.setattr(gdp_mod, "chunk_gated_delta_product", chunk_fp32)
    torch.manual_seed(0)
    layer = gdp_mod.GatedDeltaProduct(hidden_size=32, head_dim=16, num_heads=2, expand_v=1.0,
                                      num_householder=2).eval()
    x = torch.randn(2, T, 32)
    with torch.no_grad():
        plain = layer(x)[0]
        with capture(layer, kernels="fla") as cap:
            hooked = layer(x)[0]
    assert torch.equal(plain, hooked)
    (call,) = cap.calls
    assert call.family == "gated_delta_product" and call.flags["micro_steps"] == 2
    assert call.flags["path"] == ("chunk" if T > 64 else "fused_recurrent")
    check_table(call, 2, True)


def test_retention_probes_after_the_tokens_last_micro_step():
    """The retention probe at the last token reads the state after its last micro-step; every
    micro-step write is an association, ``j`` and ``distance`` count tokens."""
    from osdn_diag.metrics.retention import retrieval_errors

    gen = torch.Generator().manual_seed(11)
    n, H, K, V, T = 2, 2, 16, 8, 12
    q, k, v, beta, g = _inputs(gen, 1, T, n, H, K, V, gated=True, zero_token=False)
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, num_householder=n, scale=None, initial_state=None,
              output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=None)
    call = GDPChunkAdapter().record(kw, GDPChunkAdapter().reference(kw), layer=0, layer_name="gdp",
                                    kernel="chunk_gated_delta_product")
    _, final64, *_ = loop64(q, k, v, beta, g, n)
    cols = retrieval_errors(call, 0, [T - 1])
    kk, vv = _unit(k)[0], v[0].double()  # [T·n, H, ·]
    assert len(cols["error"]) == T * n * H  # no zero values here
    for p, h, j, dist, err in zip(*(cols[c].tolist() for c in ("probe", "head", "j", "distance", "error"))):
        assert p == T - 1 and 0 <= j < T and dist == T - 1 - j
    for h in range(H):
        rows = [i for i, hh in enumerate(cols["head"].tolist()) if hh == h]
        want = ((final64[0, h] @ kk[:, h].T).T - vv[:, h]).square().sum(-1) / vv[:, h].square().sum(-1)
        got = cols["error"][rows].double()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
        assert cols["j"][rows].tolist() == [r // n for r in range(T * n)]


def test_typed_column_and_what_if_write_key():
    """``step`` is declared int32 in the family's COLUMNS (plain names keep the value type); a
    what-if transform (d from phase 1 over the micro-step keys) replays with its write key."""
    from osdn_diag.replay import families
    from osdn_diag.whatif import WhatIf

    assert "step" in families.columns() and all(isinstance(c, str) for c in families.columns())
    assert families.column_types()["step"] == "int32" and "token_ratio" not in families.column_types()
    gen = torch.Generator().manual_seed(5)
    n, H, K, V, T = 2, 2, 16, 8, 10
    q, k, v, beta, g = _inputs(gen, 1, T, n, H, K, V, gated=True)
    kw = dict(q=q, k=k, v=v, g=g, beta=beta, num_householder=n, scale=None, initial_state=None,
              output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=None)
    call = GDPChunkAdapter().record(kw, GDPChunkAdapter().reference(kw), layer=0, layer_name="gdp",
                                    kernel="chunk_gated_delta_product")
    cf = WhatIf(eta=0.5)(call)
    res = replay_call(cf, tolerance=math.inf)
    # fp64 loop with the write key d ⊙ k on the interleaved record.
    wk = (cf.d * cf.k).double()
    kk, vv, bb, gg = cf.k.double(), cf.v.double(), cf.beta.double(), cf.g.double()
    for h in range(H):
        S = torch.zeros(V, K, dtype=torch.float64)
        for r in range(T * n):
            i = h * T * n + r
            pairs = [(kk[0, x, h], vv[0, x, h]) for x in range(r - r % n, r - r % n + n)]
            if r % n == 0:  # the token's loss before its gate, and after its decay
                L0, Ld = _pairs_loss(S, pairs), _pairs_loss(math.exp(float(gg[0, r, h])) * S, pairs)
            S = S * math.exp(float(gg[0, r, h]))
            before = 0.5 * float(((S @ kk[0, r, h] - vv[0, r, h]) ** 2).sum())
            S = S + float(bb[0, r, h]) * torch.outer(vv[0, r, h] - S @ kk[0, r, h], wk[0, r, h])
            after = 0.5 * float(((S @ kk[0, r, h] - vv[0, r, h]) ** 2).sum())
            assert int(res.columns["pos"][i]) == r // n and int(res.columns["step"][i]) == r % n
            _close(float(res.columns["loss_after"][i]), after, "what-if loss_after", 1e-3 * before)
            if r % n == n - 1:  # the token's ratio under the counterfactual writes, on all its rows
                L1 = _pairs_loss(S, pairs)
                for x in range(i - n + 1, i + 1):
                    _close(float(res.columns["token_ratio"][x]), _q(L1, L0), "what-if token_ratio", 1e-3)
                    _close(float(res.columns["token_ratio_post"][x]), _q(L1, Ld), "what-if token_ratio_post", 1e-3)
