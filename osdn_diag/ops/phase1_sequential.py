"""OSDN phase 1's sequential forward kernel: one program per (sequence, head) walks the tokens in
order, updating the preconditioner ``d`` and writing each token's preconditioned key (the recurrence
and its conventions: :mod:`osdn_diag.ops.phase1`). Its launcher and small helpers live here too, so
that the token-parallel kernel (:mod:`osdn_diag.ops.phase1_parallel`), which hands it the (sequence,
head) pairs its rounds leave unsettled, and the public op (:mod:`osdn_diag.ops.phase1`) both build on
this module without importing each other."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import load_d0, sequence_bounds, step_size_terms

__all__ = ["MAX_K", "NUM_WARPS", "osdn_phase1_fwd_kernel", "sequential_fwd"]

MAX_K = 256


# --- forward ------------------------------------------------------------------------------------


@triton.jit
def _fwd_load(k, beta, r, scalars, t, eos, i_h, o_k,
              H: tl.constexpr, K: tl.constexpr, RET: tl.constexpr):
    """Token ``t``'s inputs, zeros past the end (``t >= eos``: the prefetch of the last group)."""
    ACC = scalars.dtype.element_ty  # the compute dtype: fp32, or fp64 for fp64 keys
    ok = t < eos
    tok = t * H + i_h
    m = o_k < tl.where(ok, K, 0)  # m_k & ok (the interpreter mis-types a block & scalar mask)
    b_k = tl.load(k + tok * K + o_k, mask=m, other=0.0).to(ACC)
    b_beta = tl.load(beta + tok, mask=ok, other=0.0).to(ACC)
    if RET == 1:
        b_r = tl.load(r + tok, mask=ok, other=1.0).to(ACC)
    elif RET == 2:
        b_r = tl.load(r + tok * K + o_k, mask=m, other=1.0).to(ACC)
    else:
        b_r = b_beta  # unused placeholder: every slot must be bound
    return b_k, b_beta, b_r


@triton.jit
def _fwd_step(b_d, b_k, b_beta, b_r, t, eos, i_h, o_k, wk, dt, eta, eps, d_min, d_max,
              H: tl.constexpr, K: tl.constexpr, RET: tl.constexpr, BOX: tl.constexpr,
              BETA_AWARE: tl.constexpr, STORE_D: tl.constexpr):
    ok = t < eos
    tok = t * H + i_h
    m = o_k < tl.where(ok, K, 0)
    # Algorithm 1, line 5: the write key uses d_t, *before* the update.
    tl.store(wk + tok * K + o_k, (b_d * b_k).to(wk.dtype.element_ty), mask=m)
    if STORE_D:
        tl.store(dt + tok * K + o_k, b_d, mask=m)
    b_s = b_k * b_k
    # c = η p (1 − p a) / n = α − γ a: α, γ depend on the token alone, so the division stays off
    # the d-dependent chain (reduction a → one FMA → the update), which is what bounds the sweep.
    alpha, gam = step_size_terms(b_s, b_beta, eta, eps, BETA_AWARE)
    a = tl.sum(b_d * b_s, axis=0)
    c = alpha - gam * a
    if RET == 0:
        b_new = b_d + c * b_s
    else:
        b_new = b_r * b_d + c * b_s
    if BOX:
        b_new = tl.minimum(tl.maximum(b_new, d_min), d_max)
    # Past the end of the sequence (last, partial group of four) d must not move.
    return tl.where(ok, b_new, b_d)


@triton.jit
def osdn_phase1_fwd_kernel(
    k, beta, r, d0, scalars, cu_seqlens, skip,
    wk, dt, dfin,
    T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
    RET: tl.constexpr,          # 0: none, 1: per (token, head) scalar [B, T, H], 2: per channel [B, T, H, K]
    D0: tl.constexpr,           # 0: ones, 1: shared [H, K], 2: per sequence [N, H, K]
    BOX: tl.constexpr, BETA_AWARE: tl.constexpr, STORE_D: tl.constexpr, VARLEN: tl.constexpr,
    SKIP: tl.constexpr,         # skip[nh] != 0: leave this (sequence, head) alone
):
    i_nh = tl.program_id(0)
    if SKIP:
        if tl.load(skip + i_nh) != 0:
            return
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = sequence_bounds(cu_seqlens, i_n, T, VARLEN)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    ACC = scalars.dtype.element_ty  # the compute dtype: fp32, or fp64 for fp64 keys
    # (Not named `params`: that name collides with a local of the launch binder of triton 3.6.)
    # The scalars come from a tensor in the compute dtype: a Python float would reach Triton as fp32,
    # which is not exact enough for the fp64 path (eta = 0.003 is not an fp32 number).
    eta = tl.load(scalars + 0)
    eps = tl.load(scalars + 1)
    d_min = tl.load(scalars + 2)
    d_max = tl.load(scalars + 3)
    b_d = load_d0(d0, i_nh, i_h, o_k, m_k, K, BK, D0, ACC)

    # Four tokens in flight: slot j holds token t + j and is refilled with token t + 4 + j right
    # after use, so each load has three steps of arithmetic to arrive. (A rotating `b0 = b1; ...`
    # would consume the fresh load at the next iteration and stall on it.)
    k0, be0, r0 = _fwd_load(k, beta, r, scalars, bos + 0, eos, i_h, o_k, H, K, RET)
    k1, be1, r1 = _fwd_load(k, beta, r, scalars, bos + 1, eos, i_h, o_k, H, K, RET)
    k2, be2, r2 = _fwd_load(k, beta, r, scalars, bos + 2, eos, i_h, o_k, H, K, RET)
    k3, be3, r3 = _fwd_load(k, beta, r, scalars, bos + 3, eos, i_h, o_k, H, K, RET)
    for t in range(bos, eos, 4):
        b_d = _fwd_step(b_d, k0, be0, r0, t + 0, eos, i_h, o_k, wk, dt, eta, eps, d_min, d_max,
                        H, K, RET, BOX, BETA_AWARE, STORE_D)
        k0, be0, r0 = _fwd_load(k, beta, r, scalars, t + 4, eos, i_h, o_k, H, K, RET)
        b_d = _fwd_step(b_d, k1, be1, r1, t + 1, eos, i_h, o_k, wk, dt, eta, eps, d_min, d_max,
                        H, K, RET, BOX, BETA_AWARE, STORE_D)
        k1, be1, r1 = _fwd_load(k, beta, r, scalars, t + 5, eos, i_h, o_k, H, K, RET)
        b_d = _fwd_step(b_d, k2, be2, r2, t + 2, eos, i_h, o_k, wk, dt, eta, eps, d_min, d_max,
                        H, K, RET, BOX, BETA_AWARE, STORE_D)
        k2, be2, r2 = _fwd_load(k, beta, r, scalars, t + 6, eos, i_h, o_k, H, K, RET)
        b_d = _fwd_step(b_d, k3, be3, r3, t + 3, eos, i_h, o_k, wk, dt, eta, eps, d_min, d_max,
                        H, K, RET, BOX, BETA_AWARE, STORE_D)
        k3, be3, r3 = _fwd_load(k, beta, r, scalars, t + 7, eos, i_h, o_k, H, K, RET)
    tl.store(dfin + i_nh * K + o_k, b_d, mask=m_k)


# --- launcher -----------------------------------------------------------------------------------

# One warp per (sequence, head): every step reduces over K, and a one-warp reduction is a shuffle
# tree; more warps add a shared-memory round trip and a barrier per reduction (H200, the benchmark
# shape: 2 warps 1.28 ms forward / 3.73 ms forward+backward, against 0.92 / 2.47 ms with 1).
NUM_WARPS = 1


def _acc_dtype(k: torch.Tensor) -> torch.dtype:
    # The reference's rule (osdn_phase1, dtype=None): fp64 for fp64 keys, fp32 otherwise (bf16 too).
    return torch.float64 if k.dtype == torch.float64 else torch.float32


def _params(eta, eps, d_min, d_max, *, dtype, device, extra=()) -> torch.Tensor:
    """The kernels' scalars ``[eta, eps, d_min, d_max, *extra]`` as a tensor (a Python float argument
    would reach Triton as fp32, too coarse for the fp64 path); the box is zeros when there is none.

    Cached: building it is a host-to-device copy, which waits for the GPU to finish the work queued
    before it. Read-only to every kernel."""
    box = (0.0, 0.0) if d_min is None else (float(d_min), float(d_max))
    return _params_tensor((float(eta), float(eps), *box, *map(float, extra)), dtype, torch.device(device))


@functools.lru_cache(maxsize=64)
def _params_tensor(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _ret_mode(retention) -> int:
    return 0 if retention is None else (1 if retention.dim() == 3 else 2)


def _d0_mode(d0) -> int:
    return 0 if d0 is None else (1 if d0.dim() == 2 else 2)


def _contig(x):
    return None if x is None else x.contiguous()


def sequential_fwd(k, beta, retention, d0, cu_seqlens, N, eta, d_min, d_max, beta_aware, eps, store_d=False,
                   *, out=None, skip=None):
    """Launch the sequential forward kernel; returns ``(write_key, d trajectory or None, d_final)``.

    ``out``: write into these ``(write_key, d or None, d_final)`` instead (``d`` decides ``store_d``);
    ``skip``: an int32 ``[N·H]`` tensor, nonzero for the (sequence, head) pairs to leave alone (the
    ones the token-parallel kernel has already computed)."""
    B, T, H, K = k.shape
    acc = _acc_dtype(k)
    k, beta, retention, d0 = map(_contig, (k, beta, retention, d0))
    if out is None:
        wk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dt = torch.empty(B, T, H, K, dtype=acc, device=k.device) if store_d else None
        dfin = torch.empty(N, H, K, dtype=acc, device=k.device)
    else:
        wk, dt, dfin = out
    scalars = _params(eta, eps, d_min, d_max, dtype=acc, device=k.device)
    dummy = scalars[:1]
    osdn_phase1_fwd_kernel[(N * H,)](
        k, beta,
        dummy if retention is None else retention,
        dummy if d0 is None else d0,
        scalars,
        dummy if cu_seqlens is None else cu_seqlens,
        dummy if skip is None else skip,
        wk, dummy if dt is None else dt, dfin,
        T, H=H, K=K, BK=triton.next_power_of_2(K),
        RET=_ret_mode(retention),
        D0=_d0_mode(d0),
        BOX=d_min is not None, BETA_AWARE=bool(beta_aware), STORE_D=dt is not None,
        VARLEN=cu_seqlens is not None, SKIP=skip is not None,
        num_warps=NUM_WARPS,
    )
    return wk, dt, dfin
