"""The chunked replay against the fp64 reference recurrence (CPU: Triton interpreter; GPU: real), on
the awkward inputs of the token-by-token replay's tests and on correlated keys."""

from __future__ import annotations

import pytest
import torch

from osdn_diag.math import delta_rule_recurrence

from _replay_cases import assert_fp32_fields_close, to_device
from _replay_cases import replay_inputs as _inputs

ops_chunk = pytest.importorskip("osdn_diag.ops.replay_chunk", reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _to(kw):
    return to_device(kw, DEVICE)


_assert_fields_close = assert_fp32_fields_close


@pytest.mark.parametrize(
    "B,T,H,K,V,gate,asym,h0",
    [
        (1, 1, 1, 8, 8, None, False, False),        # one token, padded keys and values
        (2, 19, 2, 8, 12, None, True, True),
        (1, 23, 2, 12, 16, "head", True, False),
        (1, 70, 3, 32, 32, "head", False, True),    # two chunks of 64, the second partial
        (2, 130, 1, 16, 40, None, True, True),      # V over several blocks, the last partial
    ],
)
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_replay_matches_reference(B, T, H, K, V, gate, asym, h0, chunk_size):
    q, k, v, beta, kw = _inputs(B * 1000 + T, B, T, H, K, V, gate=gate, asym=asym, h0=h0)
    ref = delta_rule_recurrence(q, k, v, beta, **kw)
    got = ops_chunk.chunk_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), chunk_size=chunk_size,
                                 block_v=16, **_to(kw))
    _assert_fields_close(got, ref)


@pytest.mark.parametrize("scale", [0.3, 1.0])
def test_chunk_replay_reads_out_with_the_scale_it_is_given(scale):
    """An explicit ``scale`` (here not K^-1/2 = 1/4) multiplies the queries of the read-out ``o``."""
    q, k, v, beta, kw = _inputs(7, 1, 20, 2, 16, 8, gate="head", asym=False, h0=True)
    ref = delta_rule_recurrence(q, k, v, beta, scale=scale, **kw)
    got = ops_chunk.chunk_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), scale=scale, **_to(kw))
    _assert_fields_close(got, ref)
    default = delta_rule_recurrence(q, k, v, beta, **kw)
    assert not torch.allclose(ref.o, default.o, rtol=1e-2)  # the scale is seen in o


@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
@pytest.mark.parametrize("K", [64, 128])
def test_chunk_replay_default_launch_by_key_width(precision, K):
    """The default launch with a head gate, a write key and an initial state, over more than one
    chunk."""
    q, k, v, beta, kw = _inputs(K + 1, 1, 80, 2, K, K, gate="head", asym=True, h0=True)
    ref = delta_rule_recurrence(q, k, v, beta, **kw)
    got = ops_chunk.chunk_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), precision=precision, **_to(kw))
    _assert_fields_close(got, ref)


@pytest.mark.parametrize("bounds,C", [([0, 11, 11, 90, 150], 32), ([0, 16, 32], 16), ([0, 0], 16), ([0, 1, 65], 64)])
def test_chunk_tables_list_every_sequences_chunks(bounds, C):
    """The chunk table against a plain loop: every sequence's chunks in order, each ending at its
    sequence's end, with the sequences' chunk and token offsets."""
    chunks, offsets = [], [0]
    for bos, eos in zip(bounds, bounds[1:]):
        chunks += [[first, eos] for first in range(bos, eos, C)]
        offsets.append(len(chunks))
    NC, got_chunks, got_offsets, got_bounds = ops_chunk._chunk_tables(bounds, C, torch.device("cpu"))
    assert NC == len(chunks)
    assert got_chunks.tolist() == chunks and got_chunks.dtype == torch.int64
    assert got_offsets.tolist() == offsets and got_bounds.tolist() == bounds


def test_chunk_replay_packed_sequences_restart():
    """Chunks restart at every packed sequence (an empty one included), each from its own state."""
    q, k, v, beta, kw = _inputs(7, 1, 150, 2, 16, 16, gate="head", asym=True, h0=False)
    cu = torch.tensor([0, 11, 11, 90, 150])
    h0 = torch.randn(4, 2, 16, 16, dtype=torch.float64)
    ref = delta_rule_recurrence(q, k, v, beta, initial_state=h0, cu_seqlens=cu, **kw)
    got = ops_chunk.chunk_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), initial_state=h0.to(DEVICE),
                                 cu_seqlens=cu.to(DEVICE), chunk_size=32, **_to(kw))
    _assert_fields_close(got, ref)
    # the empty sequence's final state is its initial state, exactly
    assert torch.equal(got.final_state[1].cpu(), h0[1].float())


@pytest.mark.parametrize("noise,beta_value,gate", [(0.0, 1.5, None), (0.03, 1.5, None), (0.03, 0.9, "head"),
                                                    (0.3, 1.9, None)])
def test_chunk_replay_correlated_keys(noise, beta_value, gate):
    """Keys that all point nearly one way (a head's keys from a model are correlated, and then the
    chunk's products cancel): with β up to 1.9 the error stays within fp32's 1e-5. (Identical keys
    with β = 1.99 reach 1.6e-5 at 16-token chunks, 5e-5 to 9e-5 at 32 and 64: docs/math.md.)"""
    gen = torch.Generator().manual_seed(11)
    B, T, H, K, V = 1, 160, 2, 32, 32
    base = torch.randn(1, 1, H, K, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(base + noise * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    beta = torch.full((B, T, H), beta_value, dtype=torch.float64)
    kw = {} if gate is None else {"g": -0.05 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)}
    ref = delta_rule_recurrence(q, k, v, beta, **kw)
    got = ops_chunk.chunk_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), **_to(kw))
    _assert_fields_close(got, ref)


def test_chunk_replay_strong_decay_does_not_overflow():
    """A log decay of −40 per token: the decay ratios of a chunk reach exp(−2,520); formed in log
    space they underflow to 0, never overflow to inf (γ_t/γ_s would be 0/0)."""
    q, k, v, beta, _ = _inputs(5, 1, 64, 1, 16, 16, gate=None, asym=False, h0=True)
    g = torch.full((1, 64, 1), -40.0, dtype=torch.float64)
    ref = delta_rule_recurrence(q, k, v, beta, g=g)
    got = ops_chunk.chunk_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), g=g.to(DEVICE))
    _assert_fields_close(got, ref)


def test_chunk_replay_zero_residuals():
    """v = 0 from a zero state: every loss is exactly zero, never NaN."""
    q, k, v, beta, _ = _inputs(3, 1, 40, 1, 16, 16, gate="head", asym=False, h0=False)
    got = ops_chunk.chunk_replay(*(x.to(DEVICE) for x in (q, k, torch.zeros_like(v), beta)), chunk_size=16)
    for name in ("loss_before", "loss_after"):
        assert torch.equal(getattr(got, name).cpu(), torch.zeros(1, 40, 1)), name


@pytest.mark.parametrize("h0", [False, True])
def test_chunk_replay_of_no_token(h0):
    """T = 0: empty per-token fields and the initial state back, no launch."""
    B, H, K, V = 2, 2, 8, 8
    q, k = torch.zeros(B, 0, H, K), torch.zeros(B, 0, H, K)
    v, beta = torch.zeros(B, 0, H, V), torch.zeros(B, 0, H)
    kw = {"initial_state": torch.randn(B, H, V, K)} if h0 else {}
    got = ops_chunk.chunk_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), **_to(kw))
    assert got.o.shape == (B, 0, H, V) and got.loss_after.shape == (B, 0, H)
    expected = kw["initial_state"] if h0 else torch.zeros(B, H, V, K)
    assert torch.equal(got.final_state.cpu(), expected)


@pytest.mark.parametrize("options,message", [
    (dict(q=torch.zeros(1, 3, 1, 129), k=torch.zeros(1, 3, 1, 129)),
     r"keys of at most 128 channels, got K = 129.*fused_replay"),
    (dict(g=torch.tensor([[[-1.0], [0.5], [-1.0]]])), r"g must be a log decay, at most 0.*fused_replay"),
    (dict(g=torch.tensor([[[-1.0], [float("nan")], [-1.0]]])), r"g must be a log decay, at most 0 everywhere and not NaN"),
    (dict(g=torch.zeros(1, 3, 1, 12)), r"g must be a per-head log decay \[B, T, H\].*fused_replay"),
    (dict(chunk_size=8), r"chunk_size must be a power of two from 16 to 64, got 8"),
    (dict(chunk_size=48), r"chunk_size must be a power of two from 16 to 64, got 48"),
    (dict(block_v=True), r"block_v must be a power of two from 16 to 128, got True"),
    (dict(num_warps=3), r"num_warps must be a power of two from 1 to 16, got 3"),
    (dict(num_stages=0), r"num_stages must be an int from 1 to 4, got 0"),
    (dict(num_stages=True), r"num_stages must be an int from 1 to 4, got True"),
    (dict(num_stages=2.0), r"num_stages must be an int from 1 to 4, got 2.0"),
    (dict(precision="tf32"), r"precision must be one of \('tf32x3', 'ieee'\), got 'tf32'"),
    (dict(initial_state=torch.zeros(1, 1, 12, 8)), r"initial_state.*\[N, H, V, K\]"),
])
def test_chunk_replay_refuses_what_it_cannot_do(options, message):
    q, k, v, beta, _ = _inputs(1, 1, 3, 1, 12, 8, gate=None, asym=False, h0=False)
    args = dict(q=q, k=k, v=v, beta=beta)
    args.update(options)
    with pytest.raises(ValueError, match=message):
        ops_chunk.chunk_replay(**_to(args))


@pytest.mark.parametrize("strong", [-20.0, -1000.0])
def test_chunk_replay_decay_ratios_keep_their_digits_after_a_strong_decay(strong):
    """One token that forgets almost everything, then slow decay: the chunk's cumulative log decays
    are large and their differences small. Summed in fp32 this lost 9e-6 (strong = −20) to 4e-4
    (−1,000) of accuracy; in fp64 it keeps the fused replay's 1e-7."""
    q, k, v, beta, _ = _inputs(3, 1, 64, 1, 16, 16, gate=None, asym=False, h0=True)
    g = torch.full((1, 64, 1), -0.001, dtype=torch.float64)
    g[0, 1, 0] = strong
    ref = delta_rule_recurrence(q, k, v, beta, g=g)
    got = ops_chunk.chunk_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), g=g.to(DEVICE), chunk_size=64)
    _assert_fields_close(got, ref, 1e-6)


@pytest.mark.parametrize("value", [-1e38, -1e300, float("-inf")])
def test_chunk_replay_takes_any_negative_log_decay(value):
    """A log decay of −inf (or beyond fp32's range) is a decay to exactly 0, as in the reference: the
    chunk's differences of cumulative decays must not become −inf − (−inf)."""
    q, k, v, beta, _ = _inputs(4, 1, 40, 1, 16, 16, gate=None, asym=True, h0=False)
    g = torch.full((1, 40, 1), -0.1, dtype=torch.float64)
    g[0, 2:4, 0] = value
    ref = delta_rule_recurrence(q, k, v, beta, g=g.clamp_min(-1e4))  # the reference refuses -inf itself
    got = ops_chunk.chunk_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), g=g.to(DEVICE), chunk_size=16)
    _assert_fields_close(got, ref)


@pytest.mark.parametrize("op", ["chunk_replay", "fused_replay"])
@pytest.mark.parametrize("T", [0, 20])
def test_replays_return_results_outside_autograd(T, op):
    """The replay is a measurement, not a differentiable op: an initial state that requires grad
    comes back as a plain tensor (a clone of it would carry the graph and give d final / d h0 = I),
    with tokens or without."""
    from osdn_diag import ops

    q, k, v, beta, _ = _inputs(5, 1, max(T, 1), 1, 16, 16, gate=None, asym=False, h0=False)
    h0 = torch.randn(1, 1, 16, 16, device=DEVICE, requires_grad=True)
    got = getattr(ops, op)(*(x[:, :T].to(DEVICE) for x in (q, k, v, beta)), initial_state=h0)
    assert not got.final_state.requires_grad and got.final_state.grad_fn is None


@pytest.mark.parametrize("op", ["chunk_replay", "fused_replay"])
@pytest.mark.parametrize("name,shape,message", [
    ("v", (1, 9, 2, 16), r"argument 'v': expected shape \[B, T, H, V\] = \[1, 10, 2, \*\], got \[1, 9, 2, 16\]"),
    ("q", (1, 10, 2, 8), r"argument 'q': expected shape \[B, T, H, K\]"),
    ("q", (1, 10, 2, 32), r"argument 'q': expected shape \[B, T, H, K\]"),
    ("beta", (1, 10, 1), r"argument 'beta': expected shape \[B, T, H\]"),
    ("write_key", (1, 10, 2, 8), r"argument 'write_key': expected shape \[B, T, H, K\]"),
    ("g", (1, 10, 1), r"argument 'g': expected shape \[B, T, H\]"),
], ids=["v-shorter", "q-narrower", "q-wider", "beta-one-head", "write-key-narrower", "g-one-head"])
def test_replays_refuse_inputs_of_the_wrong_shape(op, name, shape, message):
    """A kernel indexes every input by k's shape: a shorter v was written past its end (the process
    crashed), a wider q read as a narrower one, a g of one head as every head's. Both replays check
    before launching."""
    from osdn_diag import ops

    q, k, v, beta, _ = _inputs(6, 1, 10, 2, 16, 16, gate=None, asym=False, h0=False)
    args = dict(q=q, k=k, v=v, beta=beta)
    args[name] = torch.zeros(shape, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        getattr(ops, op)(**_to(args))


def test_replays_refuse_integer_inputs():
    from osdn_diag import ops

    q, k, v, beta, _ = _inputs(6, 1, 4, 1, 16, 16, gate=None, asym=False, h0=False)
    for op in (ops.chunk_replay, ops.fused_replay):
        with pytest.raises(ValueError, match=r"argument 'q': expected a floating-point tensor, got dtype torch.int64"):
            op(q.long().to(DEVICE), *(x.to(DEVICE) for x in (k, v, beta)))


def test_fused_replay_reads_a_strided_cu_seqlens_as_its_values():
    """A strided view of the offsets (every second entry) went to the kernel as is, which read the
    storage as if packed: the wrong bounds, and heap corruption."""
    from osdn_diag import ops

    q, k, v, beta, kw = _inputs(8, 1, 20, 1, 16, 16, gate="head", asym=False, h0=False)
    cu = torch.tensor([0, 99, 3, 99, 7, 99, 20, 99])[::2]
    ref = delta_rule_recurrence(q, k, v, beta, cu_seqlens=cu.contiguous(), **kw)
    for op in (ops.chunk_replay, ops.fused_replay):
        got = op(*(x.to(DEVICE) for x in (q, k, v, beta)), cu_seqlens=cu.to(DEVICE), **_to(kw))
        _assert_fields_close(got, ref)


def test_chunk_replay_keeps_a_non_finite_input_in_its_chunk():
    """A NaN in one token's value spreads over its chunk (from the chunk's first token: products with
    zeros keep it) and on through its sequence and head, never to earlier chunks, other heads or
    other sequences (docstring)."""
    q, k, v, beta, kw = _inputs(9, 2, 40, 2, 16, 16, gate="head", asym=False, h0=False)
    v = v.clone()
    v[0, 37, 0, 3] = float("nan")
    ref = delta_rule_recurrence(q, k, v, beta, allow_nonfinite=True, **kw)
    got = ops_chunk.chunk_replay(*(x.to(DEVICE) for x in (q, k, v, beta)), chunk_size=16, **_to(kw))
    for name in ("o", "loss_before", "loss_after"):
        x = getattr(got, name).cpu()
        finite = torch.isfinite(x.reshape(2, 40, 2, -1)).all(-1)
        assert finite[0, :32, 0].all() and not finite[0, 32:, 0].any(), name
        assert finite[1].all() and finite[0, :, 1].all(), name
        r = getattr(ref, name)
        assert torch.allclose(x[1].double(), r[1], rtol=1e-5, atol=1e-6), name
        assert torch.allclose(x[0, :32, 0].double(), r[0, :32, 0], rtol=1e-5, atol=1e-6), name
