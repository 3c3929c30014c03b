"""The two-pass chunked replay (``osdn_diag.ops.replay_chunk_states``) against the fp64 reference
recurrence (CPU: Triton interpreter; GPU: real), on awkward inputs, and against the one-pass chunked
replay where both apply. Shapes stay small: every case runs in the interpreter."""

from __future__ import annotations

import pytest
import torch

from osdn_diag.math import delta_rule_recurrence

from _replay_cases import FIELDS, assert_fp32_fields_close, to_device
from _replay_cases import replay_inputs as _inputs

ops_states = pytest.importorskip("osdn_diag.ops.replay_chunk_states", reason="needs triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _to(kw):
    return to_device(kw, DEVICE)


def _run(q, k, v, beta, **kw):
    return ops_states.chunk_replay_states(*(x.to(DEVICE) for x in (q, k, v, beta)), **_to(kw))


_assert_fields_close = assert_fp32_fields_close


@pytest.mark.parametrize(
    "B,T,H,K,V,gate,asym,h0,launch",
    [
        (1, 1, 1, 8, 8, None, False, False, {}),                      # one token, padded keys and values
        (1, 1, 1, 8, 8, "head", True, True, {}),
        (2, 19, 2, 8, 12, None, True, True, {}),                      # T not a multiple of the chunk
        (1, 23, 2, 12, 16, "head", True, False, {}),                  # K = 12, padded to 16
        (1, 70, 3, 32, 32, "head", False, True, dict(block_k=16)),    # two key tiles, several chunks
        (1, 45, 2, 24, 20, None, True, True, dict(block_k=16)),       # two key tiles, the second partial
        (1, 20, 1, 40, 16, "head", True, True, dict(block_k=16)),     # three key tiles, the last partial
        (2, 130, 1, 16, 40, None, True, True, dict(block_v=16, out_block_v=16)),  # V over 3 blocks, last partial
        (1, 130, 2, 16, 40, "head", True, True, dict(block_v=16, out_block_v=32)),  # different V-blocks per pass
    ],
)
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_replay_states_matches_reference(B, T, H, K, V, gate, asym, h0, launch, chunk_size):
    q, k, v, beta, kw = _inputs(B * 1000 + T + K, B, T, H, K, V, gate=gate, asym=asym, h0=h0)
    ref = delta_rule_recurrence(q, k, v, beta, **kw)
    got = _run(q, k, v, beta, chunk_size=chunk_size, **launch, **kw)
    _assert_fields_close(got, ref)


@pytest.mark.parametrize("gate", [None, "head"])
def test_chunk_replay_states_keys_of_256_channels(gate):
    """K = 256: four register tiles of 64 key rows in the state walk (the default launch)."""
    q, k, v, beta, kw = _inputs(256, 1, 19, 1, 256, 12, gate=gate, asym=True, h0=True)
    ref = delta_rule_recurrence(q, k, v, beta, **kw)
    _assert_fields_close(_run(q, k, v, beta, chunk_size=16, **kw), ref)


@pytest.mark.parametrize("precision", ["tf32x3", "ieee"])
def test_chunk_replay_states_precisions(precision):
    q, k, v, beta, kw = _inputs(17, 1, 40, 2, 16, 16, gate="head", asym=True, h0=True)
    ref = delta_rule_recurrence(q, k, v, beta, **kw)
    _assert_fields_close(_run(q, k, v, beta, chunk_size=32, precision=precision, **kw), ref)


@pytest.mark.parametrize("scale", [0.3, 1.0])
def test_chunk_replay_states_reads_out_with_the_scale_it_is_given(scale):
    q, k, v, beta, kw = _inputs(7, 1, 20, 2, 16, 8, gate="head", asym=False, h0=True)
    ref = delta_rule_recurrence(q, k, v, beta, scale=scale, **kw)
    _assert_fields_close(_run(q, k, v, beta, scale=scale, **kw), ref)
    default = delta_rule_recurrence(q, k, v, beta, **kw)
    assert not torch.allclose(ref.o, default.o, rtol=1e-2)  # the scale is seen in o


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_replay_states_packed_sequences_restart(chunk_size):
    """Three packed sequences of unequal lengths (and an empty one), each from its own initial state."""
    q, k, v, beta, kw = _inputs(7, 1, 150, 2, 16, 16, gate="head", asym=True, h0=False)
    cu = torch.tensor([0, 11, 11, 90, 150])
    h0 = torch.randn(4, 2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = delta_rule_recurrence(q, k, v, beta, initial_state=h0, cu_seqlens=cu, **kw)
    got = _run(q, k, v, beta, initial_state=h0, cu_seqlens=cu, chunk_size=chunk_size, **kw)
    _assert_fields_close(got, ref)
    # the empty sequence's final state is its initial state, exactly
    assert torch.equal(got.final_state[1].cpu(), h0[1].float())


@pytest.mark.parametrize("log_decay", [-5.0, -40.0])
def test_chunk_replay_states_strong_decay(log_decay):
    """A log decay of −5 (or −40) per token: γ underflows to 0 within a 64-token chunk (e^−320), and the
    stored states of later chunks are the decayed ones."""
    q, k, v, beta, kw = _inputs(5, 1, 100, 2, 16, 16, gate=None, asym=True, h0=True)
    g = torch.full((1, 100, 2), log_decay, dtype=torch.float64)
    g[0, :, 1] = -0.02  # the other head decays slowly: its state lives across chunks
    ref = delta_rule_recurrence(q, k, v, beta, g=g, **kw)
    _assert_fields_close(_run(q, k, v, beta, g=g, **kw), ref)


@pytest.mark.parametrize("value", [-1000.0, float("-inf")])
def test_chunk_replay_states_one_token_forgets_everything(value):
    """One token that forgets (almost) all, then slow decay: large cumulative log decays with small
    differences (fp64 sums in the preparation), and a decay to exactly 0."""
    q, k, v, beta, kw = _inputs(3, 1, 64, 1, 16, 16, gate=None, asym=False, h0=True)
    g = torch.full((1, 64, 1), -0.001, dtype=torch.float64)
    g[0, 1, 0] = value
    ref = delta_rule_recurrence(q, k, v, beta, g=g.clamp_min(-1e4), **kw)
    _assert_fields_close(_run(q, k, v, beta, g=g, **kw), ref, 1e-6)


@pytest.mark.parametrize("gate", [None, "head"])
def test_chunk_replay_states_beta_near_0_and_2(gate):
    """β near 2 (each write overshoots, the residual flips sign) beside β near 0 (nothing written)."""
    q, k, v, beta, kw = _inputs(29, 1, 70, 2, 16, 16, gate=gate, asym=False, h0=True)
    gen = torch.Generator().manual_seed(3)
    beta = beta.clone()
    beta[..., 0] = 1.9 + 0.09 * torch.rand(1, 70, generator=gen, dtype=torch.float64)
    beta[..., 1] = 1e-6 * torch.rand(1, 70, generator=gen, dtype=torch.float64)
    ref = delta_rule_recurrence(q, k, v, beta, **kw)
    _assert_fields_close(_run(q, k, v, beta, chunk_size=32, **kw), ref)


def test_chunk_replay_states_zero_keys():
    """A head whose keys are all zero (nothing is written; its residuals are −v from the initial
    state), beside a head with keys, and zero write keys on a third."""
    q, k, v, beta, kw = _inputs(31, 1, 40, 3, 16, 16, gate="head", asym=True, h0=True)
    k = k.clone()
    k[:, :, 0] = 0.0
    kw["write_key"] = kw["write_key"].clone()
    kw["write_key"][:, :, 0] = 0.0
    kw["write_key"][:, :, 2] = 0.0
    ref = delta_rule_recurrence(q, k, v, beta, **kw)
    got = _run(q, k, v, beta, chunk_size=16, **kw)
    _assert_fields_close(got, ref)
    assert torch.equal(got.write_gain[:, :, 0].cpu(), torch.zeros(1, 40))


def test_chunk_replay_states_zero_residuals():
    """v = 0 from a zero state: every loss is exactly zero, never NaN."""
    q, k, v, beta, _ = _inputs(3, 1, 40, 1, 16, 16, gate="head", asym=False, h0=False)
    got = _run(q, k, torch.zeros_like(v), beta, chunk_size=16)
    for name in ("loss_before", "loss_after"):
        assert torch.equal(getattr(got, name).cpu(), torch.zeros(1, 40, 1)), name


@pytest.mark.parametrize("gate,chunk_size", [(None, 16), ("head", 64), ("head", 32)])
def test_chunk_replay_states_equals_the_one_pass_replay(gate, chunk_size):
    """Where both apply (K ≤ 128), the two chunked replays compute the same products in another order:
    within 1e-6 of each other, field by field."""
    ops_chunk = pytest.importorskip("osdn_diag.ops.replay_chunk")
    q, k, v, beta, kw = _inputs(41, 2, 75, 2, 32, 24, gate=gate, asym=True, h0=True)
    args = [x.to(DEVICE) for x in (q, k, v, beta)]
    one = ops_chunk.chunk_replay(*args, chunk_size=chunk_size, block_v=16, **_to(kw))
    two = ops_states.chunk_replay_states(*args, chunk_size=chunk_size, block_v=16, **_to(kw))
    for name in FIELDS:
        a, b = getattr(one, name), getattr(two, name)
        assert (a is None) == (b is None), name
        if a is not None:
            err = ((b.double() - a.double()).norm() / a.double().norm()).item()
            assert err <= 1e-6, f"{name}: {err:.3g}"


@pytest.mark.parametrize("h0", [False, True])
def test_chunk_replay_states_of_no_token(h0):
    """T = 0: empty per-token fields and the initial state back, no launch."""
    B, H, K, V = 2, 2, 8, 8
    q, k = torch.zeros(B, 0, H, K), torch.zeros(B, 0, H, K)
    v, beta = torch.zeros(B, 0, H, V), torch.zeros(B, 0, H)
    kw = {"initial_state": torch.randn(B, H, V, K)} if h0 else {}
    got = _run(q, k, v, beta, **kw)
    assert got.o.shape == (B, 0, H, V) and got.loss_after.shape == (B, 0, H)
    expected = kw["initial_state"] if h0 else torch.zeros(B, H, V, K)
    assert torch.equal(got.final_state.cpu(), expected)


def test_chunk_replay_states_keeps_a_non_finite_input_in_its_chunk():
    """As the one-pass replay: a NaN in one token's value spreads over its chunk from the chunk's first
    token and on through its sequence and head, never to earlier chunks, other heads or sequences."""
    q, k, v, beta, kw = _inputs(9, 2, 40, 2, 16, 16, gate="head", asym=False, h0=False)
    v = v.clone()
    v[0, 37, 0, 3] = float("nan")
    ref = delta_rule_recurrence(q, k, v, beta, allow_nonfinite=True, **kw)
    got = _run(q, k, v, beta, chunk_size=16, **kw)
    for name in ("o", "loss_before", "loss_after", "loss_before_decayed"):
        x = getattr(got, name).cpu()
        finite = torch.isfinite(x.reshape(2, 40, 2, -1)).all(-1)
        assert finite[0, :32, 0].all() and not finite[0, 32:, 0].any(), name
        assert finite[1].all() and finite[0, :, 1].all(), name
        r = getattr(ref, name)
        assert torch.allclose(x[1].double(), r[1], rtol=1e-5, atol=1e-6), name
        assert torch.allclose(x[0, :32, 0].double(), r[0, :32, 0], rtol=1e-5, atol=1e-6), name
    assert not torch.isfinite(got.final_state[0, 0]).all() and torch.isfinite(got.final_state[0, 1]).all()


def test_chunk_replay_states_refuses_states_over_its_memory_bound():
    """The stored states are NC·H·V·K·4 bytes: here 2 chunks × 2 heads × 8 × 12 × 4 = 1,536 bytes,
    refused one byte below that, before anything is allocated."""
    q, k, v, beta, _ = _inputs(1, 1, 20, 2, 12, 8, gate=None, asym=False, h0=False)
    assert ops_states.state_bytes([0, 20], 2, 12, 8, 16) == 1536
    with pytest.raises(ValueError, match=r"2 chunks x H = 2 x V = 8 x K = 12 x 4 bytes .*1536 bytes.*"
                                         r"over max_state_bytes = 1535"):
        _run(q, k, v, beta, chunk_size=16, max_state_bytes=1535)
    got = _run(q, k, v, beta, chunk_size=16, max_state_bytes=1536)
    _assert_fields_close(got, delta_rule_recurrence(q, k, v, beta))


@pytest.mark.parametrize("options,message", [
    (dict(q=torch.zeros(1, 3, 1, 257), k=torch.zeros(1, 3, 1, 257)),
     r"keys of at most 256 channels, got K = 257.*fused_replay"),
    (dict(q=torch.zeros(1, 3, 1, 256), k=torch.zeros(1, 3, 1, 256), block_k=32),
     r"block_k = 32 splits K = 256 key channels into 8 tiles, at most 4 are held: give block_k ≥ 64"),
    (dict(g=torch.tensor([[[-1.0], [0.5], [-1.0]]])), r"g must be a log decay, at most 0.*fused_replay"),
    (dict(g=torch.tensor([[[-1.0], [float("nan")], [-1.0]]])), r"g must be a log decay, at most 0 everywhere and not NaN"),
    (dict(g=torch.zeros(1, 3, 1, 12)), r"g must be a per-head log decay \[B, T, H\].*fused_replay"),
    (dict(chunk_size=8), r"chunk_size must be a power of two from 16 to 64, got 8"),
    (dict(chunk_size=128), r"chunk_size must be a power of two from 16 to 64, got 128"),
    (dict(block_v=24), r"block_v must be a power of two from 16 to 128, got 24"),
    (dict(block_k=8), r"block_k must be a power of two from 16 to 256, got 8"),
    (dict(out_block_v=256), r"out_block_v must be a power of two from 16 to 128, got 256"),
    (dict(num_warps=3), r"num_warps must be a power of two from 1 to 16, got 3"),
    (dict(out_num_warps=32), r"out_num_warps must be a power of two from 1 to 16, got 32"),
    (dict(num_stages=0), r"num_stages must be an int from 1 to 4, got 0"),
    (dict(max_state_bytes=-1), r"max_state_bytes must be a non-negative int, got -1"),
    (dict(max_state_bytes=1.5), r"max_state_bytes must be a non-negative int, got 1.5"),
    (dict(precision="tf32"), r"precision must be one of \('tf32x3', 'ieee'\), got 'tf32'"),
    (dict(initial_state=torch.zeros(1, 1, 12, 8)), r"initial_state.*\[N, H, V, K\]"),
    (dict(v=torch.zeros(1, 2, 1, 8)), r"argument 'v': expected shape \[B, T, H, V\]"),
])
def test_chunk_replay_states_refuses_what_it_cannot_do(options, message):
    q, k, v, beta, _ = _inputs(1, 1, 3, 1, 12, 8, gate=None, asym=False, h0=False)
    args = dict(q=q, k=k, v=v, beta=beta)
    args.update(options)
    with pytest.raises(ValueError, match=message) as info:
        ops_states.chunk_replay_states(**_to(args))
    assert str(info.value).startswith("chunk_replay_states: ") or "argument" in str(info.value)
