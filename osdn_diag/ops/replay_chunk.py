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

Two kernels. :func:`_chunk_prep_kernel`, in parallel over all chunks and heads, forms everything
that does not depend on the state: ``A = (I + L)⁻¹ diag(β)`` (so that ``δ = A (V − diag(γ) K S₀ᵀ)``;
forward substitution inside 16×16 blocks, then the blocks merged by products) and the masked,
decayed ``C×C`` matrices above. :func:`_chunk_walk_kernel`, one program per (V-block, sequence, head),
walks the sequence's chunks in order with ``S`` (as ``Sᵀ``, ``[K, BV]``) in registers: per chunk
``S₀k_t`` and ``S₀q_t``, the writes, the state at the chunk's end, then the residuals and outputs
from the same products. Nothing of the size of the state is stored per chunk: the walk reads the
inputs and the ``C×C`` matrices, and writes the results.
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

from ..runtime.checks import check_cu_seqlens, check_recurrence_inputs, check_shape
from ..runtime.host import to_device
from ..runtime.interpret import check_launchable
from ..math.recurrence import RecurrenceResult
from ._common import finite_scale, int_in_range, power_of_two, replay_result

__all__ = ["MAX_KEY_DIM", "PRECISIONS", "GrowingStateError", "chunk_replay"]

#: Widest key the chunked replay takes: a program holds ``Sᵀ`` as ``[K, BV]`` and a chunk's ``[C, K]``
#: key tiles in registers. (At K = 256, with fewer state rows per program, it computes the same to
#: 7.5e-7 but runs at a third of the fused replay's speed on an H200: ``benchmarks/CHANGELOG.md``, series 23.)
MAX_KEY_DIM = 128


class GrowingStateError(ValueError):
    """A log decay above 0 (or NaN): the state grows, and the chunk's products of decay ratios would
    cancel; :func:`osdn_diag.ops.replay.fused_replay` replays it."""

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
def _unit_lower_inverse(L, C: tl.constexpr, PRECISION: tl.constexpr):
    """``(I + L)⁻¹`` of a strictly lower-triangular ``[C, C]`` ``L``, blockwise: forward substitution
    inside the diagonal 16×16 blocks (all blocks at once, 15 steps for any C), then the blocks merged
    by products. With ``D = I + L_bd`` the block diagonal and ``E = L − L_bd`` the blocks below it,
    ``(D + E)⁻¹ = (I + N)⁻¹ D⁻¹`` with ``N = D⁻¹E``, nilpotent (``N^{C/16} = 0``), so
    ``(I + N)⁻¹ = (I − N)(I + N²)`` for up to four blocks."""
    o_t = tl.arange(0, C)
    o_r = o_t % 16
    same = (o_t[:, None] // 16) == (o_t[None, :] // 16)
    L_bd = tl.where(same, L, 0.0)
    # Row r of X = D⁻¹ is e_r − Σ_s L_rs X_s over the earlier rows s of r's block. At step i the rows
    # r ≡ i (mod 16) of every block go together: their sums live in disjoint column blocks, so one
    # vector holds them all.
    X = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    for i in range(1, 16):
        l_i = tl.sum(tl.where(o_r[:, None] == i, L_bd, 0.0), axis=0)     # rows ≡ i of L, [C] over s
        x_i = tl.sum(l_i[:, None] * X, axis=0)                          # their sums, [C] over columns
        X = tl.where((o_r[:, None] == i) & same, X - x_i[None, :], X)
    if C > 16:
        N = tl.dot(X, L - L_bd, input_precision=PRECISION)
        if C > 32:
            X = X + tl.dot(tl.dot(N, N, input_precision=PRECISION), X, input_precision=PRECISION)
        X = X - tl.dot(N, X, input_precision=PRECISION)
    return X


@triton.jit
def _chunk_prep_kernel(
    q, k, wk, beta, g, chunks, scale, M, dec, gain,
    H: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, NM: tl.constexpr,
    GATE: tl.constexpr, HAS_WK: tl.constexpr, PRECISION: tl.constexpr,
):
    """One program per (chunk, head), in parallel: everything of the chunk that does not depend on the
    state. ``M[c, h]`` (``[NM, C, C]``) holds ``A = (I + L)⁻¹ diag(β)`` (:func:`_unit_lower_inverse`) and the
    masked, decayed products of the keys with the write keys that carry the writes ``δ`` to each
    residual: ``Mb`` (before the write, ``s < t``, decays to ``t − 1``), ``Ma`` (after it, ``s ≤ t``),
    ``Mo`` (the outputs: queries, ``s ≤ t``) and, with a gate, ``Mu`` (the decayed state before the write,
    ``s < t``, decays to ``t``). With a gate, ``dec[c, h]`` (``[3, C]``) holds ``γ_t``, ``γ_{t−1}`` and
    ``γ_C / γ_t``. Also each token's write gain ``β⟨w, k⟩``."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start = tl.load(chunks + 2 * i_c).to(tl.int64)
    end = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
    o_t = tl.arange(0, C)
    m_t = start + o_t < end
    tok = (start + o_t) * H + i_h
    b_beta = tl.load(beta + tok, mask=m_t, other=0.0)
    b_scale = tl.load(scale)
    KW = tl.zeros([C, C], dtype=tl.float32)     # ⟨k_t, w_s⟩
    QW = tl.zeros([C, C], dtype=tl.float32)     # ⟨scale·q_t, w_s⟩
    kw = tl.zeros([C], dtype=tl.float32)        # ⟨k_t, w_t⟩
    for i_k in tl.static_range(0, K, BK):
        o_k = i_k + tl.arange(0, BK)
        m = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + tok[:, None] * K + o_k[None, :], mask=m, other=0.0)
        b_q = tl.load(q + tok[:, None] * K + o_k[None, :], mask=m, other=0.0) * b_scale
        if HAS_WK:
            b_w = tl.load(wk + tok[:, None] * K + o_k[None, :], mask=m, other=0.0)
        else:
            b_w = b_k
        KW += tl.dot(b_k, tl.trans(b_w), input_precision=PRECISION)
        QW += tl.dot(b_q, tl.trans(b_w), input_precision=PRECISION)
        kw += tl.sum(b_k * b_w, axis=1)
    tl.store(gain + tok, b_beta * kw, mask=m_t)
    strict = o_t[:, None] > o_t[None, :]
    incl = o_t[:, None] >= o_t[None, :]
    p_m = M + (i_c * H + i_h).to(tl.int64) * NM * C * C + o_t[:, None] * C + o_t[None, :]
    if GATE:
        G, G_prev = _chunk_decay(g, tok, m_t, GATE, C)
        # exp of a non-positive exponent only: above the diagonal (and past the end) it is masked to 0
        KWd = KW * _decay(tl.where(incl, G[:, None] - G[None, :], 0.0))
        L = tl.where(strict, b_beta[:, None] * KWd, 0.0)
        tl.store(p_m + C * C, tl.where(strict, KW * _decay(tl.where(strict, G_prev[:, None] - G[None, :], 0.0)), 0.0))
        tl.store(p_m + 2 * C * C, tl.where(incl, KWd, 0.0))
        tl.store(p_m + 3 * C * C, tl.where(incl, QW * _decay(tl.where(incl, G[:, None] - G[None, :], 0.0)), 0.0))
        tl.store(p_m + 4 * C * C, tl.where(strict, KWd, 0.0))
        G_end = tl.sum(tl.where(o_t == C - 1, G, 0.0), axis=0)      # tokens past the end add no decay
        p_d = dec + (i_c * H + i_h).to(tl.int64) * 3 * C + o_t
        tl.store(p_d, _decay(G))
        tl.store(p_d + C, _decay(G_prev))
        tl.store(p_d + 2 * C, _decay(G_end - G))
    else:
        L = tl.where(strict, b_beta[:, None] * KW, 0.0)
        tl.store(p_m + C * C, tl.where(strict, KW, 0.0))
        tl.store(p_m + 2 * C * C, tl.where(incl, KW, 0.0))
        tl.store(p_m + 3 * C * C, tl.where(incl, QW, 0.0))
    tl.store(p_m, _unit_lower_inverse(L, C, PRECISION) * b_beta[None, :])


@triton.jit
def _chunk_walk_kernel(
    q, k, v, wk, M, dec, h0, bounds, chunk_offsets, scale,
    o, lb, lbd, la, ht,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NM: tl.constexpr, GATE: tl.constexpr, HAS_WK: tl.constexpr, HAS_H0: tl.constexpr,
    PRECISION: tl.constexpr, STAGES: tl.constexpr,
):
    """One program per (V-block, sequence·head), the only sequential part: the sequence's chunks in
    order with ``Sᵀ`` ``[BK, BV]`` in registers. Per chunk, from the state it starts from: the products
    ``S₀k_t`` and ``S₀q_t``, the writes ``δ = A (V − diag(γ) K S₀ᵀ)``, every token's residuals before
    and after its write and its output (this V-block's share of each loss, ``[B·T·H, NV]``), then the
    state at the chunk's end. Chunk ``i`` of sequence ``n`` starts at token ``bos + i·C``: addresses
    affine in the loop's index, which lets the compiler load a chunk ahead (``STAGES``)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    NV = tl.num_programs(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(bounds + i_n).to(tl.int64)
    eos = tl.load(bounds + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_t = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    o_s = o_k[:, None] + o_v[None, :] * K       # Sᵀ[key, v] of the V×K row-major state
    m_s = m_k[:, None] & m_v[None, :]
    o_c = o_t[:, None] * C + o_t[None, :]
    St = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        St += tl.load(h0 + i_nh.to(tl.int64) * V * K + o_s, mask=m_s, other=0.0)
    b_scale = tl.load(scale)
    for i in tl.range(0, tl.cdiv(eos - bos, C), num_stages=STAGES):
        start = bos + i * C
        m_t = start + o_t < eos
        tok = (start + o_t) * H + i_h
        mk = m_t[:, None] & m_k[None, :]
        mv = m_t[:, None] & m_v[None, :]
        b_k = tl.load(k + tok[:, None] * K + o_k[None, :], mask=mk, other=0.0)
        b_q = tl.load(q + tok[:, None] * K + o_k[None, :], mask=mk, other=0.0) * b_scale
        b_v = tl.load(v + tok[:, None] * V + o_v[None, :], mask=mv, other=0.0)
        if HAS_WK:
            b_w = tl.load(wk + tok[:, None] * K + o_k[None, :], mask=mk, other=0.0)
        else:
            b_w = b_k
        p_m = M + ((c0 + i) * H + i_h) * NM * C * C + o_c
        # The chain from one chunk's state to the next first (S₀k_t, the writes, the state at the end),
        # then what hangs off it.
        KS = tl.dot(b_k, St, input_precision=PRECISION)     # S₀ k_t, [C, BV]
        if GATE:
            p_d = dec + ((c0 + i) * H + i_h) * 3 * C + o_t
            gam = tl.load(p_d)
            KSg = gam[:, None] * KS
        else:
            KSg = KS
        delta = tl.dot(tl.load(p_m), b_v - KSg, input_precision=PRECISION)     # δ_s = β_s u_s
        QS = tl.dot(b_q, St, input_precision=PRECISION)     # S₀ q_t
        if GATE:
            gam_end = tl.load(p_d + 2 * C)                                      # γ_C / γ_s
            St = tl.sum(tl.where(o_t == C - 1, gam, 0.0), axis=0) * St         # γ_C S₀
            St += tl.dot(tl.trans(b_w * gam_end[:, None]), delta, input_precision=PRECISION)
            e_before = tl.load(p_d + C)[:, None] * KS + tl.dot(tl.load(p_m + C * C), delta,
                                                              input_precision=PRECISION) - b_v
            u = b_v - KSg - tl.dot(tl.load(p_m + 4 * C * C), delta, input_precision=PRECISION)
            tl.store(lbd + tok * NV + i_v, 0.5 * tl.sum(u * u, axis=1), mask=m_t)
            b_o = gam[:, None] * QS
        else:
            St += tl.dot(tl.trans(b_w), delta, input_precision=PRECISION)
            e_before = KS + tl.dot(tl.load(p_m + C * C), delta, input_precision=PRECISION) - b_v
            b_o = QS
        e_after = KSg + tl.dot(tl.load(p_m + 2 * C * C), delta, input_precision=PRECISION) - b_v
        b_o += tl.dot(tl.load(p_m + 3 * C * C), delta, input_precision=PRECISION)
        tl.store(lb + tok * NV + i_v, 0.5 * tl.sum(e_before * e_before, axis=1), mask=m_t)
        tl.store(la + tok * NV + i_v, 0.5 * tl.sum(e_after * e_after, axis=1), mask=m_t)
        tl.store(o + tok[:, None] * V + o_v[None, :], b_o, mask=mv)
    tl.store(ht + i_nh.to(tl.int64) * V * K + o_s, St, mask=m_s)


def _chunk_tables(bounds: list[int], C: int, device) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(NC, chunks, offsets, bounds)`` on ``device``, from the sequences' token bounds
    ``[0, t_1, …, B·T]`` (the checked ``cu_seqlens``, or every T tokens). ``chunks`` ``[NC, 2]``: each
    chunk's first token and its sequence's end (flattened token indices); chunks restart at every
    sequence start. Sequence n's chunks are rows ``offsets[n]:offsets[n+1]`` and its tokens
    ``bounds[n]:bounds[n+1]``. All int64, built on the host and moved in one copy that does not wait
    for the GPU (from pinned memory): a blocking copy would hold the host until the work queued
    before it had finished, and the GPU idle while the host then prepares this launch."""
    edges = torch.tensor(bounds, dtype=torch.int64)
    bos, eos = edges[:-1], edges[1:]
    counts = (eos - bos + C - 1) // C
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    NC = int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts)
    first = bos[seq] + (torch.arange(NC) - offsets[:-1][seq]) * C
    host = torch.cat([torch.stack([first, eos[seq]], 1).view(-1), offsets, edges])
    table = to_device(host, device)
    return NC, table[: 2 * NC].view(NC, 2), table[2 * NC : 2 * NC + len(offsets)], table[2 * NC + len(offsets) :]


def _check_inputs(op: str, q, k, v, beta, write_key, g, initial_state, precision,
                  scale) -> tuple[int, int, int, int, int]:
    """``(B, T, H, K, V)`` of a chunked replay's inputs, checked without reading their values (shapes,
    dtypes, one device; a per-head gate; ``precision``; a finite ``scale`` or ``None``):
    ``ValueError`` names ``op``."""
    finite_scale(op, scale)
    B, T, H, K, V = check_recurrence_inputs(q, k, v, beta, write_key, g, device=q.device,
                                            initial_state=initial_state)
    if K < 1 or V < 1:
        raise ValueError(f"{op}: keys and values need at least one channel, got K = {K} (k's last "
                         f"dimension) and V = {V} (v's)")
    if g is not None and g.dim() != 3:
        raise ValueError(f"{op}: g must be a per-head log decay [B, T, H], got shape {list(g.shape)}; "
                         "the key-channel gate is replayed by osdn_diag.ops.fused_replay")
    if precision not in PRECISIONS:
        raise ValueError(f"{op}: precision must be one of {PRECISIONS}, got {precision!r}")
    return B, T, H, K, V


def _check_sequences(op: str, device, g, cu_seqlens, initial_state, B, T, H, K, V, kernel) -> list[int]:
    """The sequences' token bounds ``[0, t_1, …, B·T]`` after the checks that read values (the gate's
    sign, ``cu_seqlens``: they wait for the GPU), the initial state's shape and that ``kernel`` can run
    on ``device``. ``ValueError`` (:class:`GrowingStateError`) names ``op``."""
    # (reads g: waits for the work queued before it). "Not ≤ 0" refuses NaN too.
    if g is not None and bool((~(g <= 0)).any()):
        raise GrowingStateError(f"{op}: g must be a log decay, at most 0 everywhere and not NaN (a growing "
                                "state makes the chunk's products cancel); osdn_diag.ops.fused_replay replays any g")
    bounds = [n * T for n in range(B + 1)] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T, device)
    N = len(bounds) - 1
    if initial_state is not None:
        check_shape("initial_state", initial_state, [N, H, V, K], "[N, H, V, K]")
    check_launchable(op, device, kernel)
    return bounds


def _fp32_inputs(q, k, v, beta, write_key, initial_state, g, scale):
    """``(q, k, v, beta, write_key, initial_state, g, scale)`` as the kernels read them: contiguous fp32
    (``None`` stays ``None``), the gate in fp64 and floored at −10⁴, the scale a one-entry fp32 tensor
    (``K^-1/2`` where ``None``)."""
    dtype = torch.float32
    cast = lambda x: None if x is None else x.to(dtype).contiguous()  # noqa: E731
    q, k, v, beta, wk, h0 = map(cast, (q, k, v, beta, write_key, initial_state))
    if g is not None:
        # fp64: the kernels sum it within each chunk (see _chunk_decay). A log decay below −10⁴ reads as
        # −10⁴: the decay is exactly 0 either way, and −inf would make −inf − (−inf) = nan of a ratio.
        g = g.detach().to(torch.float64).clamp_min(-1e4).contiguous()
    K = k.shape[-1]
    scale_t = torch.full((1,), K**-0.5 if scale is None else scale, dtype=dtype, device=q.device)
    return q, k, v, beta, wk, h0, g, scale_t


def _no_token_state(h0, N, H, V, K, device) -> torch.Tensor:
    """The final state where no sequence has a token: the initial state back (zeros where ``None``),
    not attached to any graph."""
    if h0 is None:
        return torch.zeros(N, H, V, K, dtype=torch.float32, device=device)
    return h0.detach().clone()


def _chunk_prep(q, k, wk, beta, g, scale_t, chunks, gain, NC, H, K, C, precision):
    """``(M, dec, NM)``: :func:`_chunk_prep_kernel` over the ``NC`` chunks of ``chunks`` and the ``H``
    heads (fp32 inputs from :func:`_fp32_inputs`); it writes each token's gain into ``gain``. ``M``
    ``[NC, H, NM, C, C]``; ``dec`` ``[NC, H, 3, C]`` with a gate, else a one-entry placeholder."""
    dummy = q.new_empty(1)
    NM = 5 if g is not None else 4
    M = torch.empty(NC, H, NM, C, C, dtype=torch.float32, device=q.device)
    dec = torch.empty(NC, H, 3, C, dtype=torch.float32, device=q.device) if g is not None else dummy
    BK = max(triton.next_power_of_2(K), 16)
    _chunk_prep_kernel[(NC, H)](
        q, k, dummy if wk is None else wk, beta, dummy if g is None else g, chunks, scale_t, M, dec, gain,
        H=H, K=K, C=C, BK=min(BK, 32), NM=NM, GATE=g is not None, HAS_WK=wk is not None, PRECISION=precision,
        # one warp keeps the substitution's reductions inside a warp; 64-token chunks spill in one
        num_warps=1 if C <= 32 else 4,
    )
    return M, dec, NM


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
    chunk_size: int = 16,
    block_v: int | None = None,
    precision: str = "tf32x3",
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> RecurrenceResult:
    """The delta-rule recurrence with both residual norms of every write, chunk by chunk in fp32:
    the contract of :func:`osdn_diag.math.recurrence.delta_rule_recurrence` on ``q``'s device (CUDA;
    the CPU under Triton's interpreter).

    Args:
        q, k: ``[B, T, H, K]`` queries and read keys, as the kernel read them (no normalisation here),
            ``K ≤ 128`` (:data:`MAX_KEY_DIM`; wider keys: ``ValueError``, ``fused_replay`` replays them).
        v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
        write_key: ``[B, T, H, K]`` (OSDN's ``d ⊙ k``) or ``None`` (the read key writes).
        g: log decay per head ``[B, T, H]``, at most 0, or ``None``. A key-channel gate ``[B, T, H, K]``
            or a positive or NaN entry (a growing state, whose chunk products cancel) is refused
            (``ValueError``; checking the sign waits for the GPU):
            :func:`~osdn_diag.ops.replay.fused_replay` replays both. Entries below −10⁴ read as −10⁴
            (the decay is exactly 0 either way).
        initial_state: ``[N, H, V, K]`` (``V×K`` per head) or ``None`` (zeros).
        cu_seqlens: ``[N + 1]`` packed sequence bounds with ``B = 1``, or ``None`` (``N = B``).
        chunk_size: tokens per chunk, a power of two from 16 to 64 (default 16).
        block_v: state rows per program of the walk (a power of two, 16 to 128; default 64, 32 with a
            gate).
        precision: ``tl.dot``'s input precision, one of :data:`PRECISIONS`.
        num_warps: warps per program of the walk (a power of two, 1 to 16; default 8, 4 with a gate).
        num_stages: chunks the walk loads ahead (``tl.range``'s pipeline stages, 1 to 4; default 2).
            The defaults are the fastest launch measured on an H200 at K = V = 128
            (``benchmarks/RESULTS.md``).

    Every input is checked (shapes, floating-point dtypes, one device; ``scale``: finite, or ``None``
    for ``K^-1/2``) before a kernel runs. A
    non-finite input makes its whole chunk non-finite, from the chunk's first token (products with
    zeros keep a NaN), where the fused replay and the reference are non-finite from that token on;
    earlier chunks, other heads and other sequences keep their values.
    Accuracy: within 1e-5 of the fp64 reference on the tests' awkward inputs and on captured keys, but
    several times the fused replay's error where the chunk's sums cancel: keys that repeat with β
    near 2, and ``loss_after`` where β⟨w, k⟩ is near 1 (``docs/math.md``).

    Returns a :class:`~osdn_diag.math.recurrence.RecurrenceResult` in fp32: outputs ``[B, T, H, V]``,
    the losses before and after each write ``[B, T, H]``, the final state ``[N, H, V, K]``."""
    B, T, H, K, V = _check_inputs("chunk_replay", q, k, v, beta, write_key, g, initial_state, precision,
                                  scale)
    if K > MAX_KEY_DIM:
        raise ValueError(f"chunk_replay: keys of at most {MAX_KEY_DIM} channels, got K = {K}: a chunk's [C, K] key "
                         "tiles would not fit in one program's registers and shared memory; "
                         "osdn_diag.ops.fused_replay replays wider keys")
    C = power_of_two("chunk_replay", "chunk_size", chunk_size, 16, 64)
    BK = max(triton.next_power_of_2(K), 16)
    if block_v is None:
        block_v = 64 if g is None else 32
    BV = power_of_two("chunk_replay", "block_v", block_v, 16, 128)
    BV = min(BV, max(triton.next_power_of_2(V), 16))
    if num_warps is None:
        num_warps = 8 if g is None else 4
    warps = power_of_two("chunk_replay", "num_warps", num_warps, 1, 16)
    stages = 2 if num_stages is None else int_in_range("chunk_replay", "num_stages", num_stages, 1, 4)
    bounds = _check_sequences("chunk_replay", q.device, g, cu_seqlens, initial_state, B, T, H, K, V,
                              _chunk_walk_kernel)
    N = len(bounds) - 1
    q, k, v, beta, wk, h0, g, scale_t = _fp32_inputs(q, k, v, beta, write_key, initial_state, g, scale)
    dtype = torch.float32
    NV = triton.cdiv(V, BV)
    # every token is written (the walk writes the outputs and losses, the preparation the gains),
    # except the decayed loss without a gate, which is not reported
    o = torch.empty_like(v)
    parts = torch.empty(3, B * T * H, NV, dtype=dtype, device=q.device)
    if g is None:
        parts[1].zero_()
    gain = torch.empty(B, T, H, dtype=dtype, device=q.device)
    NC, chunks, offsets, bounds_t = _chunk_tables(bounds, C, q.device)
    if not NC:  # no token: the initial state back, not attached to any graph
        ht = _no_token_state(h0, N, H, V, K, q.device)
    else:
        ht = torch.empty(N, H, V, K, dtype=dtype, device=q.device)  # every (sequence, head) is written
        dummy = q.new_empty(1)
        M, dec, NM = _chunk_prep(q, k, wk, beta, g, scale_t, chunks, gain, NC, H, K, C, precision)
        flags = dict(GATE=g is not None, HAS_WK=wk is not None, PRECISION=precision)
        _chunk_walk_kernel[(NV, N * H)](
            q, k, v, dummy if wk is None else wk, M, dec, dummy if h0 is None else h0, bounds_t,
            offsets, scale_t, o, parts[0], parts[1], parts[2], ht,
            H=H, K=K, V=V, C=C, BK=BK, BV=BV, NM=NM, HAS_H0=h0 is not None, **flags,
            STAGES=stages, num_warps=warps,
        )
    return replay_result(o, ht, parts, gain, gated=g is not None)
