"""OSDN phase 1, token-parallel: the whole sequence's step sizes as one Picard fixed point.

Phase 1 moves ``d`` by clamped-affine maps, ``d_{t+1} = M_t(d_t) = clamp(r_t d_t + c_t s_t)``, whose
step size ``c_t = α_t − γ_t ⟨d_t, s_t⟩`` depends on ``d_t`` (``s_t = k_t ⊙ k_t``; see
:mod:`osdn_diag.math.phase1_blocked` for the algebra). Given every ``c_t``, the trajectory is a
composition of per-channel maps, parallel over chunks of tokens and over channels; the ``c_t`` are
the fixed point of ``c ← α − γ ⊙ ⟨D(c), s⟩``, found by Picard rounds over whole sequences. Two kernels
make a round:

1. *carry* — one program per (sequence, head, 16 channels) composes the chunk maps by an associative
   scan over the chunks and applies them to ``d_0``: the ``d`` entering each chunk, and the final ``d``;
2. *sweep* — one program per (chunk of :data:`CHUNK` tokens, sequence, head) walks its chunk from
   that ``d`` under the current step sizes: it emits ``k̃_t = D_t ⊙ k_t`` (and ``D_t``), computes the
   next step sizes and how far they moved, and composes the chunk's maps *under the next step
   sizes* into the one map the next round's carry applies. Where the next round's trajectory cannot
   stand (it comes before ``emit_from``: by default, the first guess's successor) the composition
   keeps only the maps' affine parts and applies the box once, after the chunk: exact while the box
   is inactive inside the chunk, and a guess either way, which the rounds after it correct.

With the step sizes fixed a map acts on each channel alone, so the walk needs no exchange between
threads, and the one reduction per token (the next ``c_t``) is off the token-to-token chain. The
sequential depth is a chunk, not the sequence; the chunks of every sequence and head run at once.
A first sweep, with ``d`` frozen at ``d_0``, gives the first guess.

**No host synchronisation.** A fixed number of rounds is launched; each (sequence, head) stops on the
device once its trajectory has settled (the carry reads the sweep's verdict and marks it done, and
every later kernel of that pair returns at once). Pairs still unsettled after the last round are
recomputed by the sequential kernel (:mod:`osdn_diag.ops.phase1`), launched with a guard that skips
the settled ones, so the result is always phase 1's and the host never waits for the GPU.

**Settled** means the trajectory a sweep emitted is within :data:`TOL_D` of phase 1's, by an estimate
the sweep accumulates at one multiply-add per channel and token. The clamp is 1-Lipschitz and the
retention at most 1, so a walk under step sizes off by ``δ_t`` is off by at most ``Σ_{j<t} |δ_j| s_j``
in each channel. The sweep walks under the previous round's step sizes and computes the next ones
from its own trajectory; their difference stands in for ``δ``. The rounds contract fast, so the two
are close, and the verdict doubles the estimate to cover the rest. On random unit keys the estimate
is within 1 % of the true error at every round (``benchmarks/picard_convergence.py``). At the
paper's setting (T = 4,096, K = 128, η = 0.003) the second round's trajectory is within 1.0e-6 of
the fp64 sweep (largest entry 3.1e-6), closer than the sequential fp32 kernel's 3.2e-6 (1.2e-5), and
settles. At η = 0.03 the rounds need five; at 0.3 they do not converge, and the sequential
kernel answers (the rounds then cost ~0.2 ms on top). Timings: ``benchmarks/bench_phase1.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime.checks import check_cu_seqlens
from ..runtime.interpret import check_launchable
from ._common import load_d0, sequence_bounds, step_size_terms
from .phase1_sequential import MAX_K, _contig, _d0_mode, _params, _ret_mode, sequential_fwd

__all__ = ["CHUNK", "EMIT_FROM", "ROUNDS", "TOL_D", "parallel_fwd"]

#: Tokens per sweep program. Longer chunks mean fewer programs and chunk maps for the same work per
#: token: 128 beat 64 on an H200 at the paper's shape (``bench_phase1.py --sweep``).
CHUNK = 128

#: Picard rounds launched before the sequential kernel takes over the unsettled (sequence, head) pairs:
#: enough for the paper's η = 0.003 (see above); beyond it the sequential sweep is the faster answer.
ROUNDS = 3
#: The first round whose trajectory may stand. Rounds before it walk without writing ``k̃`` (half
#: a sweep's memory traffic) and get no verdict: at the paper's setting round 1 never settles.
EMIT_FROM = 2
#: How far (absolute, in every channel and token) a settled trajectory may be from phase 1's, by the
#: estimate of the module docstring: the largest error of the sequential fp32 kernel at the paper's
#: setting (1.2e-5), rounded down.
TOL_D = 1e-5


@triton.jit
def _compose(a1, b1, lo1, hi1, a2, b2, lo2, hi2):
    """(a2, b2, lo2, hi2) ∘ (a1, b1, lo1, hi1) for x ↦ min(max(a x + b, lo), hi), a ≥ 0. A map with
    a = 0 forgets its input — bounds included, which may be infinite (no box): 0 · inf must not
    become nan."""
    lo = tl.minimum(tl.maximum(a2 * tl.where(a2 == 0, 0.0, lo1) + b2, lo2), hi2)
    hi = tl.minimum(tl.maximum(a2 * tl.where(a2 == 0, 0.0, hi1) + b2, lo2), hi2)
    return a2 * a1, a2 * b1 + b2, lo, hi


@triton.jit
def _load(k, beta, r, c, coef, t, end, i_h, o_k,
          H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, RET: tl.constexpr, FIRST: tl.constexpr):
    """Token ``t``'s key, retention and scalars: ``(β, ‖k‖²-floor)`` for the first sweep, else this
    round's step size and the stored ``(α, γ)``. Past ``end``: a zero key and r = 1 (the identity map
    on the box, so nothing past the end moves d or the chunk map) and zero scalars."""
    ok = t < end
    tok = t * H + i_h
    m = o_k < tl.where(ok, K, 0)  # m_k & ok (the interpreter mis-types a block & scalar mask)
    b_k = tl.load(k + tok * K + o_k, mask=m, other=0.0).to(tl.float32)
    if FIRST:
        x0 = tl.load(beta + tok, mask=ok, other=0.0).to(tl.float32)
        x1 = x0
        x2 = x0
    else:
        x0 = tl.load(c + tok, mask=ok, other=0.0)
        x1 = tl.load(coef + 2 * tok, mask=ok, other=0.0)
        x2 = tl.load(coef + 2 * tok + 1, mask=ok, other=0.0)
    if RET == 1:
        b_r = tl.load(r + tok, mask=ok, other=1.0).to(tl.float32) + tl.zeros([BK], tl.float32)
    elif RET == 2:
        b_r = tl.load(r + tok * K + o_k, mask=m, other=1.0).to(tl.float32)
    else:
        b_r = b_k  # unused placeholder: every slot must be bound
    return b_k, b_r, x0, x1, x2


@triton.jit
def _step(b_d, sa, sb, slo, shi, drift, b_k, b_r, x0, x1, x2, t, end, i_h, o_k,
          c_out, coef, wk, dt, eta, eps, d_min, d_max,
          H: tl.constexpr, K: tl.constexpr, RET: tl.constexpr, BOX: tl.constexpr,
          BETA_AWARE: tl.constexpr, STORE_D: tl.constexpr, FIRST: tl.constexpr, EMIT: tl.constexpr,
          EXACT: tl.constexpr):
    """One token of the sweep: the next step size from ``d_t``; ``k̃_t`` and ``d_t``; the chunk map under
    the next step sizes, extended by this token's map; ``d_t → d_{t+1}`` under this round's step size.

    ``c = α − γ ⟨d, s⟩`` with ``α = η p / max(‖k‖², ε)`` and ``γ = α p`` depending on the token alone:
    the first sweep computes and stores them (``coef``), the later ones load them, which leaves one
    reduction per token."""
    ok = t < end
    tok = t * H + i_h
    m = o_k < tl.where(ok, K, 0)
    b_s = b_k * b_k
    if FIRST:
        alpha, gam = step_size_terms(b_s, x0, eta, eps, BETA_AWARE)
        tl.store(coef + 2 * tok, alpha, mask=ok)
        tl.store(coef + 2 * tok + 1, gam, mask=ok)
    else:
        alpha = x1
        gam = x2
    gam_a = gam * tl.sum(b_d * b_s, axis=0)
    c_next = alpha - gam_a
    tl.store(c_out + tok, c_next, mask=ok)
    # The next round's chunk map: this token's map (under c_next) after those before it; without
    # EXACT, its affine part only (the box is applied once, after the chunk).
    if RET == 0:  # slope 1: the composition is a shift, clamped
        sb = sb + c_next * b_s
        if EXACT:
            slo = tl.minimum(tl.maximum(slo + c_next * b_s, d_min), d_max)
            shi = tl.minimum(tl.maximum(shi + c_next * b_s, d_min), d_max)
    elif EXACT:
        sa, sb, slo, shi = _compose(sa, sb, slo, shi, b_r, c_next * b_s, d_min, d_max)
    else:
        sa = b_r * sa
        sb = b_r * sb + c_next * b_s
    if EMIT:
        # Algorithm 1: the write key uses d_t, before the update.
        tl.store(wk + tok * K + o_k, (b_d * b_k).to(wk.dtype.element_ty), mask=m)
        if STORE_D:
            tl.store(dt + tok * K + o_k, b_d, mask=m)
        # The verdict's estimate (only a sweep that emits gets one). Past the end every term is 0.
        drift += tl.abs(c_next - x0) * b_s
    if not FIRST:
        if RET == 0:
            b_d = b_d + x0 * b_s
        else:
            b_d = b_r * b_d + x0 * b_s
        if BOX:
            b_d = tl.minimum(tl.maximum(b_d, d_min), d_max)
    return b_d, sa, sb, slo, shi, drift


@triton.jit
def picard_sweep_kernel(
    k, beta, r, d0, scalars, cu_seqlens, c_in, d_in, state,
    c_out, coef, err, summ, wk, dt,
    T, NC, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    RET: tl.constexpr, D0: tl.constexpr, BOX: tl.constexpr, BETA_AWARE: tl.constexpr,
    STORE_D: tl.constexpr, VARLEN: tl.constexpr, FIRST: tl.constexpr, EMIT: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Chunk ``j`` of (sequence, head) ``nh`` under the step sizes ``c_in``, from ``d_in[nh, j]``:
    writes ``k̃`` and ``D`` (``STORE_D``), the next step sizes ``c_out``, ``err[nh, j, :]`` (the drift:
    ``Σ_t |c_out,t − c_in,t| s_t`` over the chunk, per channel) and ``summ[nh, j] = (a, b, lo, hi)``, the
    chunk's maps under ``c_out`` composed.
    ``FIRST``: the first guess, ``d`` frozen at ``d_0`` (writes ``c_out``, ``summ`` and the per-token
    ``coef = (α, γ)``). ``EMIT``: write ``k̃``, ``D`` and the drift (a sweep whose trajectory cannot
    stand, as no verdict follows it, skips them). ``EXACT``: ``summ`` with every token's clamp; else
    its affine part, clamped to the box once (for a successor whose trajectory cannot stand either).
    Returns at once for a pair already settled (``state[nh] != 0``)."""
    i_j, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = sequence_bounds(cu_seqlens, i_n, T, VARLEN)
    t0 = bos + i_j * BT
    if FIRST:
        going = t0 < eos
    else:
        going = (t0 < eos) & (tl.load(state + i_nh) == 0)
    if going:
        end = tl.minimum(t0 + BT, eos)
        o_k = tl.arange(0, BK)
        m_k = o_k < K
        eta = tl.load(scalars + 0)
        eps = tl.load(scalars + 1)
        if BOX:
            d_min = tl.load(scalars + 2)
            d_max = tl.load(scalars + 3)
        else:
            d_min = -float("inf")
            d_max = float("inf")
        if FIRST:
            b_d = load_d0(d0, i_nh, i_h, o_k, m_k, K, BK, D0, tl.float32)
        else:
            b_d = tl.load(d_in + (i_nh.to(tl.int64) * NC + i_j) * K + o_k, mask=m_k, other=1.0)
        sa = tl.full([BK], 1.0, tl.float32)
        sb = tl.zeros([BK], tl.float32)
        slo = tl.full([BK], -float("inf"), tl.float32)
        shi = tl.full([BK], float("inf"), tl.float32)
        drift = tl.zeros([BK], tl.float32)
        # Eight tokens in flight: slot j holds token t + j and is refilled with token t + 8 + j right
        # after use, so each load has seven steps of work to arrive (four were measurably too few).
        k0, r0, a0, b0, g0 = _load(k, beta, r, c_in, coef, t0 + 0, end, i_h, o_k, H, K, BK, RET, FIRST)
        k1, r1, a1, b1, g1 = _load(k, beta, r, c_in, coef, t0 + 1, end, i_h, o_k, H, K, BK, RET, FIRST)
        k2, r2, a2, b2, g2 = _load(k, beta, r, c_in, coef, t0 + 2, end, i_h, o_k, H, K, BK, RET, FIRST)
        k3, r3, a3, b3, g3 = _load(k, beta, r, c_in, coef, t0 + 3, end, i_h, o_k, H, K, BK, RET, FIRST)
        k4, r4, a4, b4, g4 = _load(k, beta, r, c_in, coef, t0 + 4, end, i_h, o_k, H, K, BK, RET, FIRST)
        k5, r5, a5, b5, g5 = _load(k, beta, r, c_in, coef, t0 + 5, end, i_h, o_k, H, K, BK, RET, FIRST)
        k6, r6, a6, b6, g6 = _load(k, beta, r, c_in, coef, t0 + 6, end, i_h, o_k, H, K, BK, RET, FIRST)
        k7, r7, a7, b7, g7 = _load(k, beta, r, c_in, coef, t0 + 7, end, i_h, o_k, H, K, BK, RET, FIRST)
        for t in range(t0, end, 8):
            b_d, sa, sb, slo, shi, drift = _step(b_d, sa, sb, slo, shi, drift, k0, r0, a0, b0, g0, t + 0, end,
                                                 i_h, o_k, c_out, coef, wk, dt, eta, eps, d_min, d_max,
                                                 H, K, RET, BOX, BETA_AWARE, STORE_D, FIRST, EMIT, EXACT)
            k0, r0, a0, b0, g0 = _load(k, beta, r, c_in, coef, t + 8, end, i_h, o_k, H, K, BK, RET, FIRST)
            b_d, sa, sb, slo, shi, drift = _step(b_d, sa, sb, slo, shi, drift, k1, r1, a1, b1, g1, t + 1, end,
                                                 i_h, o_k, c_out, coef, wk, dt, eta, eps, d_min, d_max,
                                                 H, K, RET, BOX, BETA_AWARE, STORE_D, FIRST, EMIT, EXACT)
            k1, r1, a1, b1, g1 = _load(k, beta, r, c_in, coef, t + 9, end, i_h, o_k, H, K, BK, RET, FIRST)
            b_d, sa, sb, slo, shi, drift = _step(b_d, sa, sb, slo, shi, drift, k2, r2, a2, b2, g2, t + 2, end,
                                                 i_h, o_k, c_out, coef, wk, dt, eta, eps, d_min, d_max,
                                                 H, K, RET, BOX, BETA_AWARE, STORE_D, FIRST, EMIT, EXACT)
            k2, r2, a2, b2, g2 = _load(k, beta, r, c_in, coef, t + 10, end, i_h, o_k, H, K, BK, RET, FIRST)
            b_d, sa, sb, slo, shi, drift = _step(b_d, sa, sb, slo, shi, drift, k3, r3, a3, b3, g3, t + 3, end,
                                                 i_h, o_k, c_out, coef, wk, dt, eta, eps, d_min, d_max,
                                                 H, K, RET, BOX, BETA_AWARE, STORE_D, FIRST, EMIT, EXACT)
            k3, r3, a3, b3, g3 = _load(k, beta, r, c_in, coef, t + 11, end, i_h, o_k, H, K, BK, RET, FIRST)
            b_d, sa, sb, slo, shi, drift = _step(b_d, sa, sb, slo, shi, drift, k4, r4, a4, b4, g4, t + 4, end,
                                                 i_h, o_k, c_out, coef, wk, dt, eta, eps, d_min, d_max,
                                                 H, K, RET, BOX, BETA_AWARE, STORE_D, FIRST, EMIT, EXACT)
            k4, r4, a4, b4, g4 = _load(k, beta, r, c_in, coef, t + 12, end, i_h, o_k, H, K, BK, RET, FIRST)
            b_d, sa, sb, slo, shi, drift = _step(b_d, sa, sb, slo, shi, drift, k5, r5, a5, b5, g5, t + 5, end,
                                                 i_h, o_k, c_out, coef, wk, dt, eta, eps, d_min, d_max,
                                                 H, K, RET, BOX, BETA_AWARE, STORE_D, FIRST, EMIT, EXACT)
            k5, r5, a5, b5, g5 = _load(k, beta, r, c_in, coef, t + 13, end, i_h, o_k, H, K, BK, RET, FIRST)
            b_d, sa, sb, slo, shi, drift = _step(b_d, sa, sb, slo, shi, drift, k6, r6, a6, b6, g6, t + 6, end,
                                                 i_h, o_k, c_out, coef, wk, dt, eta, eps, d_min, d_max,
                                                 H, K, RET, BOX, BETA_AWARE, STORE_D, FIRST, EMIT, EXACT)
            k6, r6, a6, b6, g6 = _load(k, beta, r, c_in, coef, t + 14, end, i_h, o_k, H, K, BK, RET, FIRST)
            b_d, sa, sb, slo, shi, drift = _step(b_d, sa, sb, slo, shi, drift, k7, r7, a7, b7, g7, t + 7, end,
                                                 i_h, o_k, c_out, coef, wk, dt, eta, eps, d_min, d_max,
                                                 H, K, RET, BOX, BETA_AWARE, STORE_D, FIRST, EMIT, EXACT)
            k7, r7, a7, b7, g7 = _load(k, beta, r, c_in, coef, t + 15, end, i_h, o_k, H, K, BK, RET, FIRST)
        if not EXACT:  # the box, once for the chunk
            slo = tl.zeros([BK], tl.float32) + d_min
            shi = tl.zeros([BK], tl.float32) + d_max
        base = summ + (i_nh.to(tl.int64) * NC + i_j) * 4 * K
        tl.store(base + 0 * K + o_k, sa, mask=m_k)
        tl.store(base + 1 * K + o_k, sb, mask=m_k)
        tl.store(base + 2 * K + o_k, slo, mask=m_k)
        tl.store(base + 3 * K + o_k, shi, mask=m_k)
        if EMIT:
            tl.store(err + (i_nh.to(tl.int64) * NC + i_j) * K + o_k, drift, mask=m_k)


@triton.jit
def picard_carry_kernel(
    d0, cu_seqlens, scalars, summ, err, state, d_in, dfin,
    T, NC, ROUND, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BT: tl.constexpr,
    BC: tl.constexpr, D0: tl.constexpr, VARLEN: tl.constexpr, CHECK: tl.constexpr, CHECK_ONLY: tl.constexpr,
):
    """Round ``ROUND`` of (sequence, head) ``nh``, channels ``[i_k·BKC, (i_k+1)·BKC)``: first (``CHECK``:
    after a sweep that walked a trajectory) the verdict on the last sweep — settled, ``state[nh] =
    ROUND − 1``, the round whose trajectory stands; then (unless ``CHECK_ONLY``) ``d_in[nh, j]``, the d
    entering chunk ``j``, and the final ``d``: the chunk maps composed by an associative scan over
    the chunks, ``BC`` at a time, and applied to ``d_0``. The verdict: settled when twice the
    largest channel's drift, summed over the chunks (``err[nh, j, :]``), is at most the tolerance on d.
    Every channel block reaches it from the same ``err``, so their order does not matter."""
    i_nh, i_k = tl.program_id(0), tl.program_id(1)
    if tl.load(state + i_nh) == 0:
        i_n, i_h = i_nh // H, i_nh % H
        bos, eos = sequence_bounds(cu_seqlens, i_n, T, VARLEN)
        n_chunks = (eos - bos + BT - 1) // BT
        o_c = tl.arange(0, BC)
        go = n_chunks >= 0  # true (a scalar tensor, as the verdict below)
        if CHECK:
            o_ka = tl.arange(0, BK)
            o_cc = tl.arange(0, 16)
            total = tl.zeros([BK], tl.float32)
            for j0 in range(0, n_chunks, 16):
                rows = j0 + o_cc
                at = (i_nh.to(tl.int64) * NC + rows)[:, None] * K + o_ka[None, :]
                total += tl.sum(tl.load(err + at, mask=(rows < n_chunks)[:, None] & (o_ka < K)[None, :],
                                        other=0.0), axis=0)
            # A NaN drift counts as unsettled (the sequential kernel then answers): tl.max would drop it.
            total = tl.where(total == total, total, float("inf"))
            settled = 2.0 * tl.max(total, axis=0) <= tl.load(scalars + 4)
            go = settled == 0
            if settled:
                tl.store(state + i_nh, ROUND - 1)
        if not CHECK_ONLY:
            if go:
                o_k = i_k * BKC + tl.arange(0, BKC)
                m_k = o_k < K
                b_d = load_d0(d0, i_nh, i_h, o_k, m_k, K, BKC, D0, tl.float32)
                for j0 in range(0, n_chunks, BC):
                    rows = j0 + o_c
                    m = (rows < n_chunks)[:, None] & m_k[None, :]
                    at = (i_nh.to(tl.int64) * NC + rows)[:, None] * 4 * K + o_k[None, :]
                    a = tl.load(summ + at + 0 * K, mask=m, other=1.0)
                    b = tl.load(summ + at + 1 * K, mask=m, other=0.0)
                    lo = tl.load(summ + at + 2 * K, mask=m, other=-float("inf"))
                    hi = tl.load(summ + at + 3 * K, mask=m, other=float("inf"))
                    a, b, lo, hi = tl.associative_scan((a, b, lo, hi), 0, _compose)
                    # Row j: d after chunk j (rows past the end hold identities: d passes through).
                    after = tl.minimum(tl.maximum(a * b_d[None, :] + b, lo), hi)
                    d_at = (i_nh.to(tl.int64) * NC + rows)[:, None] * K + o_k[None, :]
                    tl.store(d_in + d_at + K, after, mask=(rows + 1 < n_chunks)[:, None] & m_k[None, :])
                    tl.store(d_in + (i_nh.to(tl.int64) * NC + j0) * K + o_k, b_d, mask=m_k)
                    b_d = tl.sum(tl.where((o_c == BC - 1)[:, None], after, 0.0), axis=0)
                tl.store(dfin + i_nh * K + o_k, b_d, mask=m_k)


def parallel_fwd(k, beta, retention, d0, cu_seqlens, N, eta, d_min, d_max, beta_aware, eps, store_d,
                 chunk: int = CHUNK, rounds: int = ROUNDS, emit_from: int | None = None,
                 stats: dict | None = None):
    """Phase 1's forward by Picard rounds over whole sequences; returns ``(write_key, d trajectory or
    None, d_final)`` like :func:`osdn_diag.ops.phase1.phase1_fwd` (``d`` and ``d_final`` fp32).

    Launches ``rounds`` rounds (those from ``emit_from``, default ``min(EMIT_FROM, rounds)``, on
    write ``k̃`` and may settle) and then the sequential kernel for the (sequence, head) pairs that
    have not settled, without waiting for the GPU (variable lengths: one wait, which reads and checks
    the offsets and finds the longest sequence). ``N``: the number of sequences (``B``, or
    ``len(cu_seqlens) - 1``).
    ``stats``, if given, waits and receives ``rounds`` (the most any settled pair took), ``settled``
    and ``sequential`` (how many pairs settled, how many the sequential kernel computed)."""
    B, T, H, K = k.shape
    # The offsets are read here anyway (the longest sequence sizes the grid): check them in full.
    offsets = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T, k.device)
    sequences = B if offsets is None else len(offsets) - 1
    if N != sequences:
        raise ValueError(f"argument 'N': expected the number of sequences, {sequences}, got {N}")
    if k.dtype == torch.float64:
        raise ValueError("argument 'k': the token-parallel kernel computes in fp32; fp64 keys need 'sequential'")
    if K > MAX_K:
        raise ValueError(f"argument 'k': K <= {MAX_K} supported, got {K}")
    if rounds < 1:
        raise ValueError(f"argument 'rounds': expected >= 1, got {rounds}")
    emit_from = min(EMIT_FROM, rounds) if emit_from is None else emit_from
    if not 1 <= emit_from <= rounds:
        raise ValueError(f"argument 'emit_from': expected 1 <= emit_from <= rounds = {rounds}, "
                         f"got {emit_from}")
    check_launchable("parallel_fwd", k.device, picard_sweep_kernel)
    k, beta, retention, d0 = map(_contig, (k, beta, retention, d0))
    dev = k.device
    longest = T if offsets is None else max(b - a for a, b in zip(offsets, offsets[1:]))
    NC = max(1, triton.cdiv(longest, chunk))
    wk = torch.empty_like(k)
    dt = torch.empty(B, T, H, K, dtype=torch.float32, device=dev) if store_d else None
    dfin = torch.empty(N, H, K, dtype=torch.float32, device=dev)
    c = [torch.empty(B, T, H, dtype=torch.float32, device=dev) for _ in range(2)]
    coef = torch.empty(B, T, H, 2, dtype=torch.float32, device=dev)
    summ = torch.empty(N * H, NC, 4, K, dtype=torch.float32, device=dev)
    d_in = torch.empty(N * H, NC, K, dtype=torch.float32, device=dev)
    err = torch.empty(N * H, NC, K, dtype=torch.float32, device=dev)
    state = torch.zeros(N * H, dtype=torch.int32, device=dev)
    scalars = _params(eta, eps, d_min, d_max, dtype=torch.float32, device=dev,
                      extra=(TOL_D,))
    dummy = scalars[:1]
    r_arg = dummy if retention is None else retention
    d0_arg = dummy if d0 is None else d0
    cu_arg = dummy if cu_seqlens is None else cu_seqlens
    consts = dict(H=H, K=K, BT=chunk)
    BKC = min(16, triton.next_power_of_2(K))
    varlen = cu_seqlens is not None
    sweep_flags = dict(RET=_ret_mode(retention), D0=_d0_mode(d0), BOX=d_min is not None,
                       BETA_AWARE=bool(beta_aware), STORE_D=store_d, VARLEN=varlen)
    grid = (NC, N * H)

    def sweep(i, c_in, c_out):
        # Round i's maps need their clamps only if round i + 1's trajectory may stand.
        picard_sweep_kernel[grid](k, beta, r_arg, d0_arg, scalars, cu_arg, c_in, d_in, state,
                                  c_out, coef, err, summ, wk, dummy if dt is None else dt, T, NC, **consts,
                                  BK=triton.next_power_of_2(K), **sweep_flags, FIRST=i == 0,
                                  EMIT=i >= emit_from, EXACT=i + 1 >= emit_from, num_warps=1)

    def carry(round_, check, check_only=False):
        picard_carry_kernel[(N * H, triton.cdiv(K, BKC))](
            d0_arg, cu_arg, scalars, summ, err, state, d_in, dfin, T, NC, round_, **consts,
            BK=triton.next_power_of_2(K), BKC=BKC,
            BC=max(16, min(64, triton.next_power_of_2(NC))), D0=_d0_mode(d0), VARLEN=varlen,
            CHECK=check, CHECK_ONLY=check_only, num_warps=2)

    sweep(0, dummy, c[1])  # c[1]: the first guess, from d frozen at d_0
    for i in range(1, rounds + 1):
        carry(i, check=i - 1 >= emit_from)  # the verdict on round i - 1
        sweep(i, c[i % 2], c[(i + 1) % 2])
    carry(rounds + 1, check=True, check_only=True)
    sequential_fwd(k, beta, retention, d0, cu_seqlens, N, eta, d_min, d_max, beta_aware, eps,
                   out=(wk, dt, dfin), skip=state)
    if stats is not None:
        s = state.cpu()
        stats["rounds"] = int(s.max()) if bool((s > 0).any()) else 0
        stats["settled"] = int((s > 0).sum())
        stats["sequential"] = int((s == 0).sum())
    return wk, dt, dfin
