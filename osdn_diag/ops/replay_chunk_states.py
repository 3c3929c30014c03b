"""Two-pass chunked replay: the chunk's starting states first (the only sequential part, three products
per chunk), then every per-token quantity from them in parallel over chunks.

Same contract, math and inputs as :func:`osdn_diag.ops.replay_chunk.chunk_replay` (read its module
docstring for the chunk's algebra: the writes ``δ = A (V − diag(γ) K S₀ᵀ)`` and every residual and
output a product of the chunk's ``C×C`` matrices with ``δ``), for keys of up to
:data:`MAX_KEY_DIM` = 256 channels, ungated or with a per-head gate. The one-pass
:func:`~osdn_diag.ops.replay_chunk.chunk_replay` walks each (V-block, sequence, head) through its
chunks and computes everything on the way (about seven products per chunk on the sequential path,
``NV·N·H`` programs); here the walk keeps only the chain from one chunk's state to the next, and the
rest runs in a second, fully parallel pass — the split of fla's ``chunk_fwd_h`` / ``chunk_fwd_o``,
written from the math above.

Three kernels:

1. :func:`~osdn_diag.ops.replay_chunk._chunk_prep_kernel` (shared with ``chunk_replay``), one program
   per (chunk, head): ``A = (I + L)⁻¹ diag(β)``, the masked decayed ``C×C`` matrices ``Mb, Ma, Mo``
   (``Mu`` with a gate), the decays ``γ_t, γ_{t−1}, γ_C/γ_t`` and each token's gain.
2. :func:`_chunk_states_kernel`, one program per (V-block of ``block_v`` state rows, sequence·head):
   ``NV·N·H`` programs with ``NV = ⌈V / block_v⌉`` (small ``block_v``, 16–32, for many programs: at
   B = H = 8, V = 256, block_v = 16 that is 1,024). It walks its sequence's chunks in order holding
   ``Sᵀ`` (``[K, block_v]`` fp32, as up to four register tiles of ``block_k`` key rows, like fla's
   ``b_h1..b_h4``). Per chunk it stores the state it starts from, then
   ``KS = K S₀ᵀ`` (product 1), ``δ = A (V − diag(γ) KS)`` (product 2, stored), and
   ``Sᵀ ← γ_C S₀ᵀ + Wᵀ diag(γ_C/γ_s) δ`` (product 3): three ``tl.dot`` (each split over the key
   tiles) on the sequential path per chunk. Registers: the state is ``K·block_v·4`` bytes per program,
   16 KB at K = 128 and 32 KB at K = 256 with block_v = 32 (64 fp32 registers a thread at 4 warps),
   8 KB / 16 KB with block_v = 16; a chunk's key and write-key tiles (``[C, K]``, 64 KB each at C = 64,
   K = 256) are dot operands, staged through shared memory rather than held.
3. :func:`_chunk_outputs_kernel`, one program per (V-block of ``out_block_v``, chunk, head), all in
   parallel: from the stored ``S₀`` and ``δ``, ``S₀k_t`` and ``S₀q_t`` (two products over the key
   tiles), then the residuals before and after each write (and the decayed one with a gate) and the
   outputs, ``C×C`` products with ``δ``; each V-block's share of each loss into the
   ``[B·T·H, NV]`` partial sums that :func:`~osdn_diag.ops._common.replay_result` adds.

Memory the op allocates (fp32, 4 bytes an entry), with ``NC = Σ_n ⌈T_n / C⌉`` chunks (``B·⌈T/C⌉``
without ``cu_seqlens``), ``NM`` = 4 (5 with a gate) and ``NV_o = ⌈V / out_block_v⌉``::

    states  NC·H·V·K·4          (the chunks' starting states; refused above ``max_state_bytes``)
    writes  B·T·H·V·4           (δ)
    M       NC·H·NM·C²·4  (+ NC·H·3·C·4 decays with a gate)
    results B·T·H·V·4 (o) + 3·B·T·H·NV_o·4 (loss partial sums) + B·T·H·4 (gains) + N·H·V·K·4 (final state)

plus fp32 copies of inputs given in another dtype. At B = 8, T = 4,096, H = 8, K = V = 256, C = 64
the states take 64 chunks × 64 (sequence, head) × 256 KB = 1 GiB, the writes 256 MiB and ``M``
256 MiB (ungated). A larger ``chunk_size`` stores fewer states (the default is 64).

Precision: every product is a ``tl.dot`` with ``precision`` (``"tf32x3"`` or ``"ieee"``, as
:data:`~osdn_diag.ops.replay_chunk.PRECISIONS`). A non-finite input makes its whole chunk non-finite
from the chunk's first token, and every later chunk of its sequence and head, as in ``chunk_replay``;
earlier chunks, other heads and other sequences keep their values.

The plain reference is :func:`osdn_diag.math.recurrence.delta_rule_recurrence`; tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..math.recurrence import RecurrenceResult
from ._common import as_int, int_in_range, power_of_two, replay_result
from .replay_chunk import (
    _check_inputs,
    _check_sequences,
    _chunk_prep,
    _chunk_tables,
    _fp32_inputs,
    _no_token_state,
)

__all__ = ["DEFAULT_MAX_STATE_BYTES", "MAX_KEY_DIM", "chunk_replay_states", "state_bytes"]

#: Widest key this replay takes: the state walk holds ``Sᵀ`` as at most four tiles of ``block_k`` rows.
MAX_KEY_DIM = 256

#: Default bound on the stored chunk states (``max_state_bytes``): 4 GiB.
DEFAULT_MAX_STATE_BYTES = 4 << 30

#: Register tiles of the state walk (``⌈K / block_k⌉`` of them): at most four.
_MAX_TILES = 4


@triton.jit
def _key_tile(x, tok, m_t, j: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Key rows ``j·BK … j·BK + BK`` of a chunk's tokens ``tok`` (``[C, BK]``; zeros past the chunk's end
    and past ``K``)."""
    o_k = j * BK + tl.arange(0, BK)
    return tl.load(x + tok[:, None] * K + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)


@triton.jit
def _state_offsets(o_v, m_v, j: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """``(offsets, mask)`` of tile ``j`` of ``Sᵀ`` (``[BK, BV]``: key rows ``j·BK …``, state rows
    ``o_v``) in a row-major ``V×K`` state."""
    o_k = j * BK + tl.arange(0, BK)
    return o_k[:, None] + o_v[None, :] * K, (o_k < K)[:, None] & m_v[None, :]


@triton.jit
def _load_state(p, o_v, m_v, j: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    off, m = _state_offsets(o_v, m_v, j, K, BK)
    return tl.load(p + off, mask=m, other=0.0)


@triton.jit
def _store_state(p, St, o_v, m_v, j: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    off, m = _state_offsets(o_v, m_v, j, K, BK)
    tl.store(p + off, St, mask=m)


@triton.jit
def _chunk_states_kernel(
    k, v, wk, M, dec, h0, bounds, chunk_offsets, delta, states, ht,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NK: tl.constexpr, NM: tl.constexpr, GATE: tl.constexpr, HAS_WK: tl.constexpr, HAS_H0: tl.constexpr,
    PRECISION: tl.constexpr, STAGES: tl.constexpr,
):
    """One program per (V-block, sequence·head): the sequence's chunks in order with ``Sᵀ`` in ``NK``
    register tiles ``[BK, BV]`` (``S1 … S4``). Per chunk: store ``S₀`` (``states[c, h]``, ``V×K``), then
    ``KS = K S₀ᵀ``, the writes ``δ = A (V − diag(γ) KS)`` (stored, ``[B·T, H, V]``) and the state at the
    chunk's end ``γ_C S₀ᵀ + Wᵀ diag(γ_C/γ_s) δ``; at the end the final state. Chunk ``i`` of sequence
    ``n`` starts at token ``bos + i·C`` (addresses affine in the loop's index: ``STAGES`` loads ahead)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(bounds + i_n).to(tl.int64)
    eos = tl.load(bounds + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_t = tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_c = o_t[:, None] * C + o_t[None, :]
    p_h0 = h0 + i_nh.to(tl.int64) * V * K
    S1 = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S1 += _load_state(p_h0, o_v, m_v, 0, K, BK)
    if NK > 1:
        S2 = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_H0:
            S2 += _load_state(p_h0, o_v, m_v, 1, K, BK)
    if NK > 2:
        S3 = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_H0:
            S3 += _load_state(p_h0, o_v, m_v, 2, K, BK)
    if NK > 3:
        S4 = tl.zeros([BK, BV], dtype=tl.float32)
        if HAS_H0:
            S4 += _load_state(p_h0, o_v, m_v, 3, K, BK)
    for i in tl.range(0, tl.cdiv(eos - bos, C), num_stages=STAGES):
        start = bos + i * C
        m_t = start + o_t < eos
        tok = (start + o_t) * H + i_h
        mv = m_t[:, None] & m_v[None, :]
        c = (c0 + i) * H + i_h
        # the state this chunk starts from, for the output pass
        p_s = states + c * V * K
        _store_state(p_s, S1, o_v, m_v, 0, K, BK)
        if NK > 1:
            _store_state(p_s, S2, o_v, m_v, 1, K, BK)
        if NK > 2:
            _store_state(p_s, S3, o_v, m_v, 2, K, BK)
        if NK > 3:
            _store_state(p_s, S4, o_v, m_v, 3, K, BK)
        b_k1 = _key_tile(k, tok, m_t, 0, K, BK)
        KS = tl.dot(b_k1, S1, input_precision=PRECISION)                   # S₀ k_t, [C, BV]
        if NK > 1:
            b_k2 = _key_tile(k, tok, m_t, 1, K, BK)
            KS += tl.dot(b_k2, S2, input_precision=PRECISION)
        if NK > 2:
            b_k3 = _key_tile(k, tok, m_t, 2, K, BK)
            KS += tl.dot(b_k3, S3, input_precision=PRECISION)
        if NK > 3:
            b_k4 = _key_tile(k, tok, m_t, 3, K, BK)
            KS += tl.dot(b_k4, S4, input_precision=PRECISION)
        b_v = tl.load(v + tok[:, None] * V + o_v[None, :], mask=mv, other=0.0)
        if GATE:
            p_d = dec + c * 3 * C + o_t
            gam = tl.load(p_d)
            KS = gam[:, None] * KS
        b_d = tl.dot(tl.load(M + c * NM * C * C + o_c), b_v - KS, input_precision=PRECISION)    # δ_s
        tl.store(delta + tok[:, None] * V + o_v[None, :], b_d, mask=mv)
        if GATE:
            gam_C = tl.sum(tl.where(o_t == C - 1, gam, 0.0), axis=0)     # γ_C (padding adds no decay)
            b_d = b_d * tl.load(p_d + 2 * C)[:, None]                      # (γ_C/γ_s) δ_s
            S1 = gam_C * S1
            if NK > 1:
                S2 = gam_C * S2
            if NK > 2:
                S3 = gam_C * S3
            if NK > 3:
                S4 = gam_C * S4
        if HAS_WK:
            b_w1 = _key_tile(wk, tok, m_t, 0, K, BK)
        else:
            b_w1 = b_k1
        S1 += tl.dot(tl.trans(b_w1), b_d, input_precision=PRECISION)
        if NK > 1:
            if HAS_WK:
                b_w2 = _key_tile(wk, tok, m_t, 1, K, BK)
            else:
                b_w2 = b_k2
            S2 += tl.dot(tl.trans(b_w2), b_d, input_precision=PRECISION)
        if NK > 2:
            if HAS_WK:
                b_w3 = _key_tile(wk, tok, m_t, 2, K, BK)
            else:
                b_w3 = b_k3
            S3 += tl.dot(tl.trans(b_w3), b_d, input_precision=PRECISION)
        if NK > 3:
            if HAS_WK:
                b_w4 = _key_tile(wk, tok, m_t, 3, K, BK)
            else:
                b_w4 = b_k4
            S4 += tl.dot(tl.trans(b_w4), b_d, input_precision=PRECISION)
    p_ht = ht + i_nh.to(tl.int64) * V * K
    _store_state(p_ht, S1, o_v, m_v, 0, K, BK)
    if NK > 1:
        _store_state(p_ht, S2, o_v, m_v, 1, K, BK)
    if NK > 2:
        _store_state(p_ht, S3, o_v, m_v, 2, K, BK)
    if NK > 3:
        _store_state(p_ht, S4, o_v, m_v, 3, K, BK)


@triton.jit
def _chunk_outputs_kernel(
    q, k, v, M, dec, chunks, delta, states, scale, o, lb, lbd, la,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NK: tl.constexpr, NM: tl.constexpr, GATE: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (V-block, chunk, head), all independent: from the chunk's stored ``S₀`` and writes
    ``δ``, ``S₀k_t`` and ``S₀q_t`` (over the key tiles), then each token's residuals before and after its
    write, with a gate the decayed one before it, and its output (the module docstring of
    :mod:`~osdn_diag.ops.replay_chunk` has the formulas); this V-block's share of each loss,
    ``[B·T·H, NV]``."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NV = tl.num_programs(0)
    start = tl.load(chunks + 2 * i_c).to(tl.int64)
    end = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
    o_t = tl.arange(0, C)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = start + o_t < end
    m_v = o_v < V
    mv = m_t[:, None] & m_v[None, :]
    tok = (start + o_t) * H + i_h
    c = i_c.to(tl.int64) * H + i_h
    p_s = states + c * V * K
    b_scale = tl.load(scale)
    KS = tl.zeros([C, BV], dtype=tl.float32)
    QS = tl.zeros([C, BV], dtype=tl.float32)
    for j in tl.static_range(NK):
        St = _load_state(p_s, o_v, m_v, j, K, BK)
        KS += tl.dot(_key_tile(k, tok, m_t, j, K, BK), St, input_precision=PRECISION)
        QS += tl.dot(_key_tile(q, tok, m_t, j, K, BK) * b_scale, St, input_precision=PRECISION)
    b_v = tl.load(v + tok[:, None] * V + o_v[None, :], mask=mv, other=0.0)
    b_d = tl.load(delta + tok[:, None] * V + o_v[None, :], mask=mv, other=0.0)
    p_m = M + c * NM * C * C + o_t[:, None] * C + o_t[None, :]
    if GATE:
        p_d = dec + c * 3 * C + o_t
        gam = tl.load(p_d)
        KSg = gam[:, None] * KS
        e_before = tl.load(p_d + C)[:, None] * KS + tl.dot(tl.load(p_m + C * C), b_d,
                                                          input_precision=PRECISION) - b_v
        u = b_v - KSg - tl.dot(tl.load(p_m + 4 * C * C), b_d, input_precision=PRECISION)
        tl.store(lbd + tok * NV + i_v, 0.5 * tl.sum(u * u, axis=1), mask=m_t)
        b_o = gam[:, None] * QS
    else:
        KSg = KS
        e_before = KS + tl.dot(tl.load(p_m + C * C), b_d, input_precision=PRECISION) - b_v
        b_o = QS
    e_after = KSg + tl.dot(tl.load(p_m + 2 * C * C), b_d, input_precision=PRECISION) - b_v
    b_o += tl.dot(tl.load(p_m + 3 * C * C), b_d, input_precision=PRECISION)
    tl.store(lb + tok * NV + i_v, 0.5 * tl.sum(e_before * e_before, axis=1), mask=m_t)
    tl.store(la + tok * NV + i_v, 0.5 * tl.sum(e_after * e_after, axis=1), mask=m_t)
    tl.store(o + tok[:, None] * V + o_v[None, :], b_o, mask=mv)


def state_bytes(bounds: list[int], H: int, K: int, V: int, chunk_size: int) -> int:
    """Bytes of the chunks' starting states :func:`chunk_replay_states` stores (``NC·H·V·K·4``) for
    sequences with token bounds ``bounds`` (``[0, t_1, …]``)."""
    NC = sum(-(-(e - b) // chunk_size) for b, e in zip(bounds, bounds[1:]))
    return NC * H * V * K * 4


def chunk_replay_states(
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
    chunk_size: int = 64,
    block_v: int = 32,
    block_k: int = 64,
    precision: str = "tf32x3",
    num_warps: int = 4,
    num_stages: int | None = None,
    out_block_v: int = 32,
    out_num_warps: int = 4,
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
) -> RecurrenceResult:
    """The delta-rule recurrence with both residual norms of every write, in two passes over chunks in
    fp32 (module docstring): the contract of :func:`osdn_diag.math.recurrence.delta_rule_recurrence` on
    ``q``'s device (CUDA; the CPU under Triton's interpreter), as
    :func:`~osdn_diag.ops.replay_chunk.chunk_replay`, for keys of up to 256 channels.

    Args:
        q, k: ``[B, T, H, K]`` queries and read keys, ``K ≤ 256`` (:data:`MAX_KEY_DIM`).
        v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
        write_key: ``[B, T, H, K]`` or ``None`` (the read key writes).
        g: log decay per head ``[B, T, H]``, at most 0, or ``None``; as ``chunk_replay`` (a key-channel
            gate, a positive or NaN entry: ``ValueError``; entries below −10⁴ read as −10⁴).
        initial_state: ``[N, H, V, K]`` or ``None`` (zeros).
        cu_seqlens: ``[N + 1]`` packed sequence bounds with ``B = 1``, or ``None`` (``N = B``).
        chunk_size: tokens per chunk, a power of two from 16 to 64 (default 64: fewer stored states).
        block_v: state rows per program of the state walk, a power of two from 16 to 128 (default 32).
        block_k: key rows per register tile of the walk's state, a power of two from 16 to 256, with
            at most four tiles (``⌈K / block_k⌉ ≤ 4``; default 64).
        precision: ``tl.dot``'s input precision, ``"tf32x3"`` or ``"ieee"``.
        num_warps, num_stages: warps per program of the state walk (a power of two, 1 to 16) and the
            chunks it loads ahead (1 to 4; default 2 where two chunks' tiles, ``4·C·(K·(1 + w) + block_v
            + C)`` bytes each with ``w`` = 1 for a write key, take at most 160 KiB of shared memory, else 1).
        out_block_v, out_num_warps: state rows per program (16 to 128) and warps (1 to 16) of the output
            pass.
        max_state_bytes: the most bytes the stored chunk states may take (default 4 GiB); more is a
            ``ValueError`` naming the sizes, before anything is allocated.

    Checks, non-finite inputs and accuracy as ``chunk_replay`` (a non-finite input makes its chunk
    non-finite from the chunk's first token, and the sequence's later chunks). Returns a
    :class:`~osdn_diag.math.recurrence.RecurrenceResult` in fp32."""
    op = "chunk_replay_states"
    B, T, H, K, V = _check_inputs(op, q, k, v, beta, write_key, g, initial_state, precision, scale)
    if K > MAX_KEY_DIM:
        raise ValueError(f"{op}: keys of at most {MAX_KEY_DIM} channels, got K = {K}; "
                         "osdn_diag.ops.fused_replay replays wider keys")
    C = power_of_two(op, "chunk_size", chunk_size, 16, 64)
    BV = power_of_two(op, "block_v", block_v, 16, 128)
    BV = min(BV, max(triton.next_power_of_2(V), 16))
    BK = power_of_two(op, "block_k", block_k, 16, 256)
    BK = min(BK, max(triton.next_power_of_2(K), 16))
    NK = triton.cdiv(K, BK)
    if NK > _MAX_TILES:
        raise ValueError(f"{op}: block_k = {block_k} splits K = {K} key channels into {NK} tiles, at most "
                         f"{_MAX_TILES} are held: give block_k ≥ {triton.next_power_of_2(triton.cdiv(K, _MAX_TILES))}")
    warps = power_of_two(op, "num_warps", num_warps, 1, 16)
    if num_stages is None:
        per_stage = 4 * C * (K * (1 + (write_key is not None)) + BV + C)   # keys, write keys, values, A
        num_stages = 2 if 2 * per_stage <= 160 << 10 else 1
    stages = int_in_range(op, "num_stages", num_stages, 1, 4)
    BVo = power_of_two(op, "out_block_v", out_block_v, 16, 128)
    BVo = min(BVo, max(triton.next_power_of_2(V), 16))
    out_warps = power_of_two(op, "out_num_warps", out_num_warps, 1, 16)
    limit = as_int(max_state_bytes)
    if limit is None or limit < 0:
        raise ValueError(f"{op}: max_state_bytes must be a non-negative int, got {max_state_bytes!r}")
    bounds = _check_sequences(op, q.device, g, cu_seqlens, initial_state, B, T, H, K, V, _chunk_states_kernel)
    N = len(bounds) - 1
    need = state_bytes(bounds, H, K, V, C)
    if need > limit:
        NC = need // (H * V * K * 4)
        raise ValueError(f"{op}: the chunks' starting states take {NC} chunks x H = {H} x V = {V} x K = {K} x 4 "
                         f"bytes = {need / 2**30:.3g} GiB ({need} bytes), over max_state_bytes = {limit}; "
                         "give a larger max_state_bytes or chunk_size, fewer tokens per call, or "
                         "osdn_diag.ops.chunk_replay / fused_replay (no stored states)")
    q, k, v, beta, wk, h0, g, scale_t = _fp32_inputs(q, k, v, beta, write_key, initial_state, g, scale)
    dtype = torch.float32
    NV, NVo = triton.cdiv(V, BV), triton.cdiv(V, BVo)
    # every token is written (the output pass writes the outputs and losses, the preparation the
    # gains), except the decayed loss without a gate, which is not reported
    o = torch.empty_like(v)
    parts = torch.empty(3, B * T * H, NVo, dtype=dtype, device=q.device)
    if g is None:
        parts[1].zero_()
    gain = torch.empty(B, T, H, dtype=dtype, device=q.device)
    NC, chunks, offsets, bounds_t = _chunk_tables(bounds, C, q.device)
    if not NC:  # no token: the initial state back, not attached to any graph
        ht = _no_token_state(h0, N, H, V, K, q.device)
        return replay_result(o, ht, parts, gain, gated=g is not None)
    ht = torch.empty(N, H, V, K, dtype=dtype, device=q.device)  # every (sequence, head) is written
    states = torch.empty(NC, H, V, K, dtype=dtype, device=q.device)  # every chunk's S₀ is written
    delta = torch.empty_like(v)                                       # every token's write too
    dummy = q.new_empty(1)
    M, dec, NM = _chunk_prep(q, k, wk, beta, g, scale_t, chunks, gain, NC, H, K, C, precision)
    _chunk_states_kernel[(NV, N * H)](
        k, v, dummy if wk is None else wk, M, dec, dummy if h0 is None else h0, bounds_t, offsets,
        delta, states, ht,
        H=H, K=K, V=V, C=C, BK=BK, BV=BV, NK=NK, NM=NM, GATE=g is not None, HAS_WK=wk is not None,
        HAS_H0=h0 is not None, PRECISION=precision, STAGES=stages, num_warps=warps,
    )
    _chunk_outputs_kernel[(NVo, NC, H)](
        q, k, v, M, dec, chunks, delta, states, scale_t, o, parts[0], parts[1], parts[2],
        H=H, K=K, V=V, C=C, BK=BK, BV=BVo, NK=NK, NM=NM, GATE=g is not None, PRECISION=precision,
        num_warps=out_warps,
    )
    return replay_result(o, ht, parts, gain, gated=g is not None)
