"""Chunked replay: the delta-rule recurrence and both residual norms of every write, a chunk of tokens
at a time on tensor cores.

Same contract as :func:`osdn_diag.ops.replay.fused_replay` (the token-by-token kernel), for the
ungated and head-gated delta rule in fp32. Within a chunk of ``C`` tokens starting from state ``S₀``
(``V×K``), with ``γ_t = exp(G_t)`` the chunk's cumulative decay (``G_t = Σ_{j≤t} g_j``; ``G ≡ 0``
without a gate), the state after token ``t`` is ::

    S_t = γ_t S₀ + Σ_{s≤t} (γ_t/γ_s) δ_s w_sᵀ,      δ_s = β_s u_s  (the write of token s)

so the writes solve one unit lower-triangular system per chunk::

    (I + L) δ = diag(β) (V − diag(γ) K S₀ᵀ),        L_ts = β_t (γ_t/γ_s) ⟨k_t, w_s⟩  (s < t)

and every per-token quantity is a product of the chunk's matrices with ``δ``::

    S_{t−1} k_t − v_t = γ_{t−1} S₀k_t + Σ_{s<t} (γ_{t−1}/γ_s) ⟨k_t, w_s⟩ δ_s − v_t     → loss_before
    v_t − S̄_t k_t     = v_t − γ_t S₀k_t − Σ_{s<t} (γ_t/γ_s) ⟨k_t, w_s⟩ δ_s           → loss_before_decayed
    S_t k_t − v_t     = γ_t S₀k_t + Σ_{s≤t} (γ_t/γ_s) ⟨k_t, w_s⟩ δ_s − v_t           → loss_after
    o_t = S_t (scale·q_t), and the next chunk's S₀ = S_C.

``loss_after`` is ``S_t k_t`` read from the chunk's representation of the state ``S_t`` (the sum
includes ``s = t``), not from Lemma 4.1's identity ``(1 − β⟨w, k⟩)·e``: the replay measures the
contraction, and the identity remains a check on it. Ratios of decays are formed in log space
(``exp(G_t − G_s)``), never as ``γ_t / γ_s``, which would underflow on long chunks of strong decay.

Three kernels, as fla's chunked delta rule is built: :func:`_chunk_solve_kernel` inverts each chunk's
``I + L`` by forward substitution and forms the state-free parts of its writes (in parallel over all
chunks and heads); :func:`_chunk_state_kernel`, the only sequential one, walks each (sequence, head,
V-block)'s chunks in order with ``S`` (as ``Sᵀ``, ``[K, BV]``) in registers, storing the state each
chunk starts from and its writes ``δ``; :func:`_chunk_output_kernel` computes every chunk's residuals
and outputs from those, in parallel.
Products run as ``tl.dot`` with ``precision`` (``"tf32x3"``: three TF32 tensor-core products that
together carry fp32's mantissa; ``"ieee"``: plain fp32 FMAs). The key-channel gate (KDA, GLA-style
decays) is not covered: it needs per-channel decay ratios inside a chunk, which overflow without
sub-chunking; :func:`~osdn_diag.ops.replay.fused_replay` replays it.

The plain reference is :func:`osdn_diag.math.recurrence.delta_rule_recurrence`; tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import check_cu_seqlens, check_recurrence_inputs, check_shape
from .._interpret import check_launchable
from ..math.recurrence import RecurrenceResult
from ._common import power_of_two, replay_result

__all__ = ["PRECISIONS", "chunk_replay"]

#: ``tl.dot``'s input precisions the replay may use, each an fp32 product (TF32 alone is not: its 10-bit
#: mantissa misses the 1e-5 the replay is held to).
PRECISIONS = ("tf32x3", "ieee")


@triton.jit
def _chunk_decay(g, tok, m_t, GATE: tl.constexpr, C: tl.constexpr):
    """``(G, G_prev)``, ``[C]`` fp64: the chunk's cumulative log decay through token t and through
    t − 1 (zeros without a gate; tokens past the sequence's end add nothing). In fp64 because decay
    ratios are differences ``G_t − G_s``: after one strongly decaying token both are large and their
    small difference would lose fp32's digits (G = −1,000: an ulp of 6e-5). The sums run as a
    masked reduction rather than a scan: the same fp64 operations as the fused replay's fp64 path."""
    o_t = tl.arange(0, C)
    if GATE:
        b_g = tl.load(g + tok, mask=m_t, other=0.0)
        G = tl.sum(tl.where(o_t[:, None] >= o_t[None, :], b_g[None, :], 0.0), axis=1)
        return G, G - b_g
    else:
        z = tl.zeros([C], dtype=tl.float64)
        return z, z


@triton.jit
def _decay(x):
    """``exp(x)`` in fp32 of an fp64 log decay (or difference of two), rounded once to fp32 first."""
    return tl.exp(x.to(tl.float32))


@triton.jit
def _chunk_solve_kernel(
    k, wk, v, beta, g, chunks, W, U,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_WK: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (chunk, head): ``A = (I + L)⁻¹ diag(β)`` by forward substitution, then the
    state-free parts of the writes, ``W = A diag(γ) K`` and ``U = A V``, so that the chunk's writes
    are ``δ = U − W S₀ᵀ`` (rows ``[start, end)`` of ``W`` ``[B·T, H, K]`` and ``U`` ``[B·T, H, V]``)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start = tl.load(chunks + 2 * i_c).to(tl.int64)
    end = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
    o_t = tl.arange(0, C)
    m_t = start + o_t < end
    tok = (start + o_t) * H + i_h
    b_beta = tl.load(beta + tok, mask=m_t, other=0.0)
    G, G_prev = _chunk_decay(g, tok, m_t, GATE, C)
    # ⟨k_t, w_s⟩ over key blocks of BK
    KW = tl.zeros([C, C], dtype=tl.float32)
    for i_k in tl.static_range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + tok[:, None] * K + o_k[None, :], mask=m, other=0.0)
        if HAS_WK:
            b_w = tl.load(wk + tok[:, None] * K + o_k[None, :], mask=m, other=0.0)
        else:
            b_w = b_k
        KW += tl.dot(b_k, tl.trans(b_w), input_precision=PRECISION)
    strict = o_t[:, None] > o_t[None, :]
    # exp of a non-positive exponent only: above the diagonal (and past the end) it is masked to 0
    if GATE:
        KW = KW * _decay(tl.where(strict, G[:, None] - G[None, :], 0.0))
    L = tl.where(strict, b_beta[:, None] * KW, 0.0)
    # Forward substitution, X = (I + L)⁻¹ one row at a time: X_i = e_i − Σ_{s<i} L_is X_s.
    X = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    for i in range(1, C):
        l_i = tl.sum(tl.where(o_t[:, None] == i, L, 0.0), axis=0)        # row i of L, [C] over s
        x_i = tl.sum(l_i[:, None] * X, axis=0)                            # Σ_s L_is X_s, [C]
        X = tl.where(o_t[:, None] == i, X - x_i[None, :], X)
    b_A = X * b_beta[None, :]
    b_Ag = b_A * _decay(G)[None, :] if GATE else b_A
    for i_k in tl.static_range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + tok[:, None] * K + o_k[None, :], mask=m, other=0.0)
        tl.store(W + tok[:, None] * K + o_k[None, :], tl.dot(b_Ag, b_k, input_precision=PRECISION), mask=m)
    for i_v in tl.static_range(0, V, BV):
        o_v = i_v + tl.arange(0, BV)
        m = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + tok[:, None] * V + o_v[None, :], mask=m, other=0.0)
        tl.store(U + tok[:, None] * V + o_v[None, :], tl.dot(b_A, b_v, input_precision=PRECISION), mask=m)


@triton.jit
def _chunk_state_kernel(
    wk, k, g, W, U, h0, chunk_offsets, chunks, S0, D, ht,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, HAS_WK: tl.constexpr, HAS_H0: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (V-block, sequence·head), the only sequential part: the sequence's chunks in
    order (rows ``chunk_offsets[n]`` to ``chunk_offsets[n+1]`` of ``chunks``), ``Sᵀ`` ``[BK, BV]`` in
    registers. Per chunk it stores the state the chunk starts from (``S0`` ``[NC, H, V, K]``) and
    the chunk's writes ``δ = U − W S₀ᵀ`` (``D`` ``[B·T, H, V]``), then moves the state to the chunk's
    end."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    o_t = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    o_s = o_k[:, None] + o_v[None, :] * K       # Sᵀ[key, v] of the V×K row-major state
    m_s = m_k[:, None] & m_v[None, :]
    St = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        St += tl.load(h0 + i_nh.to(tl.int64) * V * K + o_s, mask=m_s, other=0.0)
    c0 = tl.load(chunk_offsets + i_n)
    c1 = tl.load(chunk_offsets + i_n + 1)
    for i_c in range(c0, c1):
        start = tl.load(chunks + 2 * i_c).to(tl.int64)
        end = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
        m_t = start + o_t < end
        tok = (start + o_t) * H + i_h
        mk = m_t[:, None] & m_k[None, :]
        tl.store(S0 + (i_c * H + i_h).to(tl.int64) * V * K + o_s, St, mask=m_s)
        b_W = tl.load(W + tok[:, None] * K + o_k[None, :], mask=mk, other=0.0)
        b_U = tl.load(U + tok[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        delta = b_U - tl.dot(b_W, St, input_precision=PRECISION)       # δ_s = β_s u_s, [C, BV]
        tl.store(D + tok[:, None] * V + o_v[None, :], delta, mask=m_t[:, None] & m_v[None, :])
        if HAS_WK:
            b_w = tl.load(wk + tok[:, None] * K + o_k[None, :], mask=mk, other=0.0)
        else:
            b_w = tl.load(k + tok[:, None] * K + o_k[None, :], mask=mk, other=0.0)
        if GATE:
            G, G_prev = _chunk_decay(g, tok, m_t, GATE, C)
            G_end = tl.sum(tl.where(o_t == C - 1, G, 0.0), axis=0)   # tokens past the end add no decay
            b_w = b_w * _decay(G_end - G)[:, None]                   # γ_C / γ_s
            St = _decay(G_end) * St
        St += tl.dot(tl.trans(b_w), delta, input_precision=PRECISION)
    tl.store(ht + i_nh.to(tl.int64) * V * K + o_s, St, mask=m_s)


@triton.jit
def _chunk_output_kernel(
    q, k, v, beta, wk, g, D, S0, chunks, scale,
    o, lb, lbd, la, gain,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BKB: tl.constexpr,
    GATE: tl.constexpr, HAS_WK: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (chunk, V-block, head), in parallel: the chunk's per-token residuals and
    outputs from its starting state and its writes. Writes this V-block's partial losses
    (``[B·T·H, NV]`` each) and its outputs. (Chunks run along the grid's first axis, the only one
    that takes more than 65,535 programs.)"""
    i_c, i_v, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NV = tl.num_programs(1)
    start = tl.load(chunks + 2 * i_c).to(tl.int64)
    end = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
    o_t = tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = start + o_t < end
    m_v = o_v < V
    tok = (start + o_t) * H + i_h
    mv = m_t[:, None] & m_v[None, :]
    b_scale = tl.load(scale)
    b_v = tl.load(v + tok[:, None] * V + o_v[None, :], mask=mv, other=0.0)
    delta = tl.load(D + tok[:, None] * V + o_v[None, :], mask=mv, other=0.0)
    # The products with S₀ and with the write keys, over key blocks of BKB: whole [C, K] tiles of
    # k, q and w next to S₀ would not fit in registers.
    KS = tl.zeros([C, BV], dtype=tl.float32)    # S₀ k_t
    QS = tl.zeros([C, BV], dtype=tl.float32)    # S₀ q_t
    KW = tl.zeros([C, C], dtype=tl.float32)     # ⟨k_t, w_s⟩
    QW = tl.zeros([C, C], dtype=tl.float32)     # ⟨q_t, w_s⟩
    kw = tl.zeros([C], dtype=tl.float32)        # ⟨k_t, w_t⟩
    p_s = S0 + (i_c * H + i_h).to(tl.int64) * V * K
    for i_k in tl.static_range(0, BK, BKB):
        o_k = i_k + tl.arange(0, BKB)
        m_k = o_k < K
        mk = m_t[:, None] & m_k[None, :]
        St = tl.load(p_s + o_k[:, None] + o_v[None, :] * K, mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_k = tl.load(k + tok[:, None] * K + o_k[None, :], mask=mk, other=0.0)
        b_q = tl.load(q + tok[:, None] * K + o_k[None, :], mask=mk, other=0.0) * b_scale
        if HAS_WK:
            b_w = tl.load(wk + tok[:, None] * K + o_k[None, :], mask=mk, other=0.0)
        else:
            b_w = b_k
        KS += tl.dot(b_k, St, input_precision=PRECISION)
        QS += tl.dot(b_q, St, input_precision=PRECISION)
        KW += tl.dot(b_k, tl.trans(b_w), input_precision=PRECISION)
        QW += tl.dot(b_q, tl.trans(b_w), input_precision=PRECISION)
        kw += tl.sum(b_k * b_w, axis=1)
    incl = o_t[:, None] >= o_t[None, :]
    strict = o_t[:, None] > o_t[None, :]
    if GATE:
        G, G_prev = _chunk_decay(g, tok, m_t, GATE, C)
        gam = _decay(G)
        D_incl = _decay(tl.where(incl, G[:, None] - G[None, :], 0.0))
        D_prev = _decay(tl.where(strict, G_prev[:, None] - G[None, :], 0.0))
        KWd = KW * D_incl
        e_before = _decay(G_prev)[:, None] * KS + tl.dot(tl.where(strict, KW * D_prev, 0.0), delta,
                                                          input_precision=PRECISION) - b_v
        u = b_v - gam[:, None] * KS - tl.dot(tl.where(strict, KWd, 0.0), delta, input_precision=PRECISION)
        tl.store(lbd + tok * NV + i_v, 0.5 * tl.sum(u * u, axis=1), mask=m_t)
        e_after = gam[:, None] * KS + tl.dot(tl.where(incl, KWd, 0.0), delta, input_precision=PRECISION) - b_v
        b_o = gam[:, None] * QS + tl.dot(tl.where(incl, QW * D_incl, 0.0), delta, input_precision=PRECISION)
    else:
        e_before = KS + tl.dot(tl.where(strict, KW, 0.0), delta, input_precision=PRECISION) - b_v
        e_after = KS + tl.dot(tl.where(incl, KW, 0.0), delta, input_precision=PRECISION) - b_v
        b_o = QS + tl.dot(tl.where(incl, QW, 0.0), delta, input_precision=PRECISION)
    tl.store(lb + tok * NV + i_v, 0.5 * tl.sum(e_before * e_before, axis=1), mask=m_t)
    tl.store(la + tok * NV + i_v, 0.5 * tl.sum(e_after * e_after, axis=1), mask=m_t)
    tl.store(o + tok[:, None] * V + o_v[None, :], b_o, mask=mv)
    if i_v == 0:
        # the write gain β⟨w, k⟩ needs no state: one V-block reports it
        b_beta = tl.load(beta + tok, mask=m_t, other=0.0)
        tl.store(gain + tok, b_beta * kw, mask=m_t)


def _chunk_table(bounds: list[int], C: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chunks, offsets)`` on ``device``, from the sequences' token bounds ``[0, t_1, …, B·T]`` (the
    checked ``cu_seqlens``, or every T tokens): ``chunks`` ``[NC, 2]`` int64, each chunk's first token
    and its sequence's end (flattened token indices); ``offsets`` ``[N + 1]``, sequence n's chunks are
    rows ``offsets[n]:offsets[n+1]``. Chunks restart at every sequence start."""
    chunks, offsets = [], [0]
    for bos, eos in zip(bounds, bounds[1:]):
        chunks.extend((first, eos) for first in range(bos, eos, C))
        offsets.append(len(chunks))
    return (torch.tensor(chunks, dtype=torch.int64).view(-1, 2).to(device),
            torch.tensor(offsets, dtype=torch.int64).to(device))


def chunk_replay(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    write_key: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 32,
    block_v: int | None = None,
    precision: str = "tf32x3",
    num_warps: int | None = None,
) -> RecurrenceResult:
    """The delta-rule recurrence with both residual norms of every write, chunk by chunk in fp32:
    the contract of :func:`osdn_diag.math.recurrence.delta_rule_recurrence` on ``q``'s device (CUDA;
    the CPU under Triton's interpreter).

    Args:
        q, k: ``[B, T, H, K]`` queries and read keys, as the kernel read them (no normalisation here),
            ``K ≤ 128`` (wider keys: ``ValueError``; ``fused_replay`` replays them).
        v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
        write_key: ``[B, T, H, K]`` (OSDN's ``d ⊙ k``) or ``None`` (the read key writes).
        g: log decay per head ``[B, T, H]``, at most 0, or ``None``. A key-channel gate ``[B, T, H, K]``
            or a positive entry (a growing state, whose chunk products cancel) is refused
            (``ValueError``; checking the sign waits for the GPU):
            :func:`~osdn_diag.ops.replay.fused_replay` replays both. Entries below −10⁴ read as −10⁴
            (the decay is exactly 0 either way).
        initial_state: ``[N, H, V, K]`` (``V×K`` per head) or ``None`` (zeros).
        cu_seqlens: ``[N + 1]`` packed sequence bounds with ``B = 1``, or ``None`` (``N = B``).
        chunk_size: tokens per chunk, a power of two from 16 to 64 (default 32, the fastest on an H200:
            ``benchmarks/RESULTS.md``).
        block_v: state rows per program (a power of two, 16 to 128; default 64).
        precision: ``tl.dot``'s input precision, one of :data:`PRECISIONS`.
        num_warps: warps per program of the walk and the outputs (a power of two, 1 to 16; default 4).

    Every input is checked (shapes, floating-point dtypes, one device) before a kernel runs.
    Accuracy: within 1e-5 of the fp64 reference on the tests' awkward inputs and on captured keys, but
    several times the fused replay's error where the chunk's sums cancel: keys that repeat with β
    near 2, and ``loss_after`` where β⟨w, k⟩ is near 1 (``docs/math.md``).

    Returns a :class:`~osdn_diag.math.recurrence.RecurrenceResult` in fp32: outputs ``[B, T, H, V]``,
    the losses before and after each write ``[B, T, H]``, the final state ``[N, H, V, K]``."""
    B, T, H, K, V = check_recurrence_inputs(q, k, v, beta, write_key, g, device=q.device,
                                            initial_state=initial_state)
    if K < 1 or V < 1:
        raise ValueError(f"chunk_replay: keys and values need at least one channel, got K = {K} (k's last "
                         f"dimension) and V = {V} (v's)")
    if g is not None and g.dim() != 3:
        raise ValueError(f"chunk_replay: g must be a per-head log decay [B, T, H], got shape {list(g.shape)}; "
                         "the key-channel gate is replayed by osdn_diag.ops.fused_replay")
    if precision not in PRECISIONS:
        raise ValueError(f"chunk_replay: precision must be one of {PRECISIONS}, got {precision!r}")
    if K > 128:
        raise ValueError(f"chunk_replay: keys of at most 128 channels, got K = {K}: a chunk's [C, K] key tiles "
                         "would not fit in one program's registers and shared memory; osdn_diag.ops.fused_replay "
                         "replays wider keys")
    C = power_of_two("chunk_replay", "chunk_size", chunk_size, 16, 64)
    BK = max(triton.next_power_of_2(K), 16)
    if block_v is None:
        block_v = 64
    BV = power_of_two("chunk_replay", "block_v", block_v, 16, 128)
    BV = min(BV, max(triton.next_power_of_2(V), 16))
    warps = 4 if num_warps is None else power_of_two("chunk_replay", "num_warps", num_warps, 1, 16)
    if g is not None and bool((g > 0).any()):  # (reads g: waits for the work queued before it)
        raise ValueError("chunk_replay: g must be a log decay, at most 0 everywhere (a growing state makes the "
                         "chunk's products cancel); osdn_diag.ops.fused_replay replays any g")
    bounds = [n * T for n in range(B + 1)] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T, q.device)
    N = len(bounds) - 1
    if initial_state is not None:
        check_shape("initial_state", initial_state, [N, H, V, K], "[N, H, V, K]")
    check_launchable("chunk_replay", q.device, _chunk_output_kernel)
    dtype = torch.float32
    cast = lambda x: None if x is None else x.to(dtype).contiguous()  # noqa: E731
    q, k, v, beta, wk, h0 = map(cast, (q, k, v, beta, write_key, initial_state))
    if g is not None:
        # fp64: the kernels sum it within each chunk (see _chunk_decay). A log decay below −10⁴ reads as
        # −10⁴: the decay is exactly 0 either way, and −inf would make −inf − (−inf) = nan of a ratio.
        g = g.detach().to(torch.float64).clamp_min(-1e4).contiguous()
    scale_t = torch.full((1,), K**-0.5 if scale is None else scale, dtype=dtype, device=q.device)
    NV = triton.cdiv(V, BV)
    o = torch.zeros_like(v)
    parts = torch.zeros(3, B * T * H, NV, dtype=dtype, device=q.device)
    gain = torch.zeros(B, T, H, dtype=dtype, device=q.device)
    chunks, offsets = _chunk_table(bounds, C, q.device)
    if not len(chunks):  # no token: the initial state back, not attached to any graph
        ht = torch.zeros(N, H, V, K, dtype=dtype, device=q.device) if h0 is None else h0.detach().clone()
    else:
        ht = torch.empty(N, H, V, K, dtype=dtype, device=q.device)  # every (sequence, head) is written
        dummy = q.new_empty(1)
        wk_, g_ = dummy if wk is None else wk, dummy if g is None else g
        W = torch.empty(B * T, H, K, dtype=dtype, device=q.device)
        U = torch.empty(B * T, H, V, dtype=dtype, device=q.device)
        D = torch.empty(B * T, H, V, dtype=dtype, device=q.device)
        S0 = torch.empty(len(chunks), H, V, K, dtype=dtype, device=q.device)
        flags = dict(GATE=g is not None, HAS_WK=wk is not None, PRECISION=precision)
        _chunk_solve_kernel[(len(chunks), H)](
            k, wk_, v, beta, g_, chunks, W, U,
            H=H, K=K, V=V, C=C, BK=min(BK, 64), BV=min(max(triton.next_power_of_2(V), 16), 64), **flags,
            num_warps=4,
        )
        _chunk_state_kernel[(NV, N * H)](
            wk_, k, g_, W, U, dummy if h0 is None else h0, offsets, chunks, S0, D, ht,
            H=H, K=K, V=V, C=C, BK=BK, BV=BV, HAS_H0=h0 is not None, **flags, num_warps=warps,
        )
        _chunk_output_kernel[(len(chunks), NV, H)](
            q, k, v, beta, wk_, g_, D, S0, chunks, scale_t,
            o, parts[0], parts[1], parts[2], gain,
            H=H, K=K, V=V, C=C, BK=BK, BV=BV, BKB=min(BK, 32), **flags, num_warps=warps,
        )
    return replay_result(o, ht, parts, gain, gated=g is not None)
