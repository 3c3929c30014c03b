"""OSDN phase 1 in Triton: the online diagonal preconditioner sweep, forward and backward.

The reference is :func:`osdn_diag.math.phase1.osdn_phase1` (same arguments, same semantics); its
docstring states the recurrence. Per (sequence, head) and token ``t``::

    k̃_t     = d_t ⊙ k_t                                          (emitted first: Algorithm 1, line 5)
    s_t     = k_t ⊙ k_t,   S_t = ‖k_t‖²,   n_t = max(S_t, ε),   p_t = β_t (beta-aware) or 1
    a_t     = ⟨d_t, s_t⟩,  c_t = η p_t (1 − p_t a_t) / n_t
    d̄_{t+1} = r_t ⊙ d_t + c_t s_t,   d_{t+1} = clamp(d̄_{t+1}, d_min, d_max)

**Forward** (:func:`osdn_phase1_fwd_kernel`): one program per (sequence, head), ``d`` in registers
(``BK = next_pow2(K)`` lanes, fp32 — fp64 for fp64 keys), a sequential loop over the tokens. The loop is
unrolled by four with the loads of token ``t + 4`` issued while token ``t`` is computed: the step's own
arithmetic is short (one lane reduction on the d-dependent chain), so without the prefetch every token
waits a full global-memory round trip for its key. Measured on an H200 (triton 3.6, B=8, T=4096, H=8,
K=128, bf16): plain ``for t in range`` loop 2.07 ms, the same loop as ``tl.range(num_stages=3)`` 1.34 ms,
this prefetch 0.92 ms; two warps instead of one 1.28 ms (a cross-warp reduction goes through shared
memory and a barrier). That is still sequential-latency bound, ~225 ns a token: above the ≤ 25 %-of-
phase-2 target (fla's chunk_delta_rule forward ~0.64 ms); see benchmarks/bench_phase1.py.

**What the backward needs** — the trajectory ``d_t``: it is *saved* (fp32, ``[B, T, H, K]``), not
recomputed. The reverse sweep needs ``d_t`` for ``t = T, T−1, …``, and the map ``d_t ↦ d_{t+1}`` cannot be
run backwards (the clamp forgets where ``d̄`` was, and a retention ``r = 0`` forgets ``d_t``), so a
recompute would have to re-run the forward into memory anyway (or checkpoint and re-sweep every chunk,
which doubles the sequential work that bounds this kernel). Storing it costs one fp32 store per token
that nothing waits on. It is stored only when a gradient is needed or asked for (``STORE_D``).

**Backward** (:func:`osdn_phase1_bwd_kernel`): one program per (sequence, head), reverse loop carrying
``g = ∂L/∂d_{t+1}`` (starting from ∂L/∂d_final, or 0). Per token, with ``w = ∂L/∂k̃_t``::

    ḡ      = g ⊙ 1[d_min ≤ d̄_{t+1} ≤ d_max]          (clamp; see the boundary convention below)
    ∂r_t   = ḡ ⊙ d_t   (per channel)  or  ⟨ḡ, d_t⟩ (per head-token scalar)
    g_c    = ⟨ḡ, s_t⟩
    g_a    = −g_c η p² / n                          (c through a = ⟨d, s⟩)
    ∂β_t   =  g_c η (1 − 2 p a) / n                 (beta-aware only; else β does not enter: 0)
    g_S    = −g_c c / n   where S_t ≥ ε, else 0     (c through n = max(S, ε))
    ∂s_t   = c ḡ + g_a d_t + g_S                    (the c s term, ⟨d, s⟩, and ‖k‖² = Σ s)
    ∂k_t   = 2 k_t ⊙ ∂s_t + d_t ⊙ w
    ∂d_t   = r_t ⊙ ḡ + g_a s_t + k_t ⊙ w  (+ ∂L/∂d_t of the returned trajectory)

and ``∂d0`` is the carry left at the first token (summed over sequences for a shared ``[H, K]`` d0; for an
empty sequence it is ∂L/∂d_final itself). ``d̄_{t+1}`` and ``c_t`` are recomputed from the saved ``d_t``,
so the only reduction on the reverse sweep's critical path is ``g_c``.

Boundary conventions (both those of torch, so that autograd through the reference agrees exactly):
the clamp passes the gradient where ``d_min ≤ d̄ ≤ d_max`` *inclusive* (``torch.clamp``) and blocks it
where the clamp is active, i.e. ``d̄`` strictly outside; ties happen in practice only for a zero key
(``d̄ = d`` exactly, and a coordinate pinned at a bound stays there): the step is the identity then, and
passing the gradient is the natural choice. The ε floor passes ``∂n`` where ``S ≥ ε`` (``clamp_min``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime.checks import check_cu_seqlens_layout
from ..runtime.interpret import check_launchable
from ..math.phase1 import Phase1Result, _validate
from ._common import sequence_bounds
from .phase1_sequential import (  # noqa: F401  (MAX_K, sequential_fwd: re-exported)
    MAX_K,
    NUM_WARPS,
    _contig,
    _params,
    _ret_mode,
    osdn_phase1_fwd_kernel,
    sequential_fwd,
)

__all__ = ["osdn_precondition", "osdn_phase1_bwd_kernel", "osdn_phase1_fwd_kernel"]

# --- backward -----------------------------------------------------------------------------------


@triton.jit
def _bwd_load(k, beta, r, dt, dwk, ddt, scalars, t, bos, i_h, o_k,
              H: tl.constexpr, K: tl.constexpr, RET: tl.constexpr, HAS_DDT: tl.constexpr):
    """Token ``t``'s inputs and incoming gradients; zeros before the start (``t < bos``)."""
    ACC = scalars.dtype.element_ty
    ok = t >= bos
    tok = t * H + i_h
    m = o_k < tl.where(ok, K, 0)  # m_k & ok (the interpreter mis-types a block & scalar mask)
    b_k = tl.load(k + tok * K + o_k, mask=m, other=0.0).to(ACC)
    b_beta = tl.load(beta + tok, mask=ok, other=0.0).to(ACC)
    # Padded lanes (K < BK) stay 0 in d_t and in the carry alike: the scalar-retention gradient sums
    # ⟨ḡ, d_t⟩ over all BK lanes.
    b_d = tl.load(dt + tok * K + o_k, mask=m, other=0.0).to(ACC)
    b_w = tl.load(dwk + tok * K + o_k, mask=m, other=0.0).to(ACC)
    if RET == 1:
        b_r = tl.load(r + tok, mask=ok, other=1.0).to(ACC)
    elif RET == 2:
        b_r = tl.load(r + tok * K + o_k, mask=m, other=1.0).to(ACC)
    else:
        b_r = b_beta  # unused placeholder
    if HAS_DDT:
        b_gt = tl.load(ddt + tok * K + o_k, mask=m, other=0.0).to(ACC)
    else:
        b_gt = b_w  # unused placeholder
    return b_k, b_beta, b_r, b_d, b_w, b_gt


@triton.jit
def _bwd_step(b_gin, b_k, b_beta, b_r, b_d, b_w, b_gt, t, bos, i_h, o_k,
              dk, dbeta, dr, eta, eps, d_min, d_max,
              H: tl.constexpr, K: tl.constexpr, RET: tl.constexpr, BOX: tl.constexpr,
              BETA_AWARE: tl.constexpr, HAS_DDT: tl.constexpr):
    """One reverse step: ``b_gin = ∂L/∂d_{t+1}`` in, ``∂L/∂d_t`` out (unchanged before the start)."""
    ok = t >= bos
    tok = t * H + i_h
    m = o_k < tl.where(ok, K, 0)
    # Recompute the forward step from the saved d_t (off the critical path: no dependence on b_g).
    b_s = b_k * b_k
    S = tl.sum(b_s, axis=0)
    inv_n = 1.0 / tl.maximum(S, eps)
    if BETA_AWARE:
        p = b_beta
    else:
        p = 1.0
    alpha = eta * p * inv_n
    gam = alpha * p
    a = tl.sum(b_d * b_s, axis=0)
    c = alpha - gam * a
    if RET == 0:
        b_rd = b_d
    else:
        b_rd = b_r * b_d
    b_g = b_gin
    if BOX:
        b_dbar = b_rd + c * b_s
        # torch.clamp's convention: gradient passes on the closed box, zero where the clamp acts.
        b_g = tl.where((b_dbar >= d_min) & (b_dbar <= d_max), b_gin, 0.0)
    if RET == 1:
        tl.store(dr + tok, tl.sum(b_g * b_d, axis=0), mask=ok)
    if RET == 2:
        tl.store(dr + tok * K + o_k, b_g * b_d, mask=m)
    # g_c is the one reduction that depends on the carry: only multiplications follow it.
    g_c = tl.sum(b_g * b_s, axis=0)
    g_a = -g_c * gam                                   # ∂c/∂a = −η p² / n
    if BETA_AWARE:
        tl.store(dbeta + tok, g_c * (eta * (1.0 - 2.0 * p * a) * inv_n), mask=ok)  # ∂c/∂p
    # ∂c/∂S = −c / n where the floor n = max(S, ε) is not active (clamp_min's convention: S ≥ ε).
    g_S = g_c * tl.where(S >= eps, -c * inv_n, 0.0)
    b_gs = c * b_g + g_a * b_d + g_S
    tl.store(dk + tok * K + o_k, (2.0 * b_k * b_gs + b_d * b_w).to(dk.dtype.element_ty), mask=m)
    if RET == 0:
        b_gd = b_g
    else:
        b_gd = b_r * b_g
    b_gd = b_gd + g_a * b_s + b_k * b_w
    if HAS_DDT:
        b_gd = b_gd + b_gt
    # Before the start of the sequence (last, partial group of four) the carry must not move.
    return tl.where(ok, b_gd, b_gin)


@triton.jit
def osdn_phase1_bwd_kernel(
    k, beta, r, dt, scalars, cu_seqlens,
    dwk, ddt, ddfin,
    dk, dbeta, dr, dd0,
    T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
    RET: tl.constexpr, BOX: tl.constexpr, BETA_AWARE: tl.constexpr,
    HAS_DDT: tl.constexpr, HAS_DDFIN: tl.constexpr, VARLEN: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = sequence_bounds(cu_seqlens, i_n, T, VARLEN)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    ACC = scalars.dtype.element_ty
    eta = tl.load(scalars + 0)
    eps = tl.load(scalars + 1)
    d_min = tl.load(scalars + 2)
    d_max = tl.load(scalars + 3)
    if HAS_DDFIN:
        b_g = tl.load(ddfin + i_nh * K + o_k, mask=m_k, other=0.0).to(ACC)
    else:
        b_g = tl.zeros([BK], dtype=ACC)

    # Reverse sweep, four tokens in flight (as in the forward): slot j holds token t − j.
    t0 = eos - 1
    k0, be0, r0, d0_, w0, gt0 = _bwd_load(k, beta, r, dt, dwk, ddt, scalars, t0 - 0, bos, i_h, o_k, H, K, RET, HAS_DDT)
    k1, be1, r1, d1_, w1, gt1 = _bwd_load(k, beta, r, dt, dwk, ddt, scalars, t0 - 1, bos, i_h, o_k, H, K, RET, HAS_DDT)
    k2, be2, r2, d2_, w2, gt2 = _bwd_load(k, beta, r, dt, dwk, ddt, scalars, t0 - 2, bos, i_h, o_k, H, K, RET, HAS_DDT)
    k3, be3, r3, d3_, w3, gt3 = _bwd_load(k, beta, r, dt, dwk, ddt, scalars, t0 - 3, bos, i_h, o_k, H, K, RET, HAS_DDT)
    for i in range(0, eos - bos, 4):
        t = t0 - i
        b_g = _bwd_step(b_g, k0, be0, r0, d0_, w0, gt0, t - 0, bos, i_h, o_k, dk, dbeta, dr,
                        eta, eps, d_min, d_max, H, K, RET, BOX, BETA_AWARE, HAS_DDT)
        k0, be0, r0, d0_, w0, gt0 = _bwd_load(
            k, beta, r, dt, dwk, ddt, scalars, t - 4,
            bos, i_h, o_k, H, K, RET, HAS_DDT)
        b_g = _bwd_step(b_g, k1, be1, r1, d1_, w1, gt1, t - 1, bos, i_h, o_k, dk, dbeta, dr,
                        eta, eps, d_min, d_max, H, K, RET, BOX, BETA_AWARE, HAS_DDT)
        k1, be1, r1, d1_, w1, gt1 = _bwd_load(
            k, beta, r, dt, dwk, ddt, scalars, t - 5,
            bos, i_h, o_k, H, K, RET, HAS_DDT)
        b_g = _bwd_step(b_g, k2, be2, r2, d2_, w2, gt2, t - 2, bos, i_h, o_k, dk, dbeta, dr,
                        eta, eps, d_min, d_max, H, K, RET, BOX, BETA_AWARE, HAS_DDT)
        k2, be2, r2, d2_, w2, gt2 = _bwd_load(
            k, beta, r, dt, dwk, ddt, scalars, t - 6,
            bos, i_h, o_k, H, K, RET, HAS_DDT)
        b_g = _bwd_step(b_g, k3, be3, r3, d3_, w3, gt3, t - 3, bos, i_h, o_k, dk, dbeta, dr,
                        eta, eps, d_min, d_max, H, K, RET, BOX, BETA_AWARE, HAS_DDT)
        k3, be3, r3, d3_, w3, gt3 = _bwd_load(
            k, beta, r, dt, dwk, ddt, scalars, t - 7,
            bos, i_h, o_k, H, K, RET, HAS_DDT)
    tl.store(dd0 + i_nh * K + o_k, b_g, mask=m_k)


# --- launchers ----------------------------------------------------------------------------------

#: The forward kernel ``method="auto"`` runs for fp16/bf16/fp32 keys: ``"sequential"`` (one token at a
#: time) or ``"parallel"`` (:mod:`osdn_diag.ops.phase1_parallel`, which hands the (sequence, head) pairs
#: its rounds do not settle to the sequential kernel); fp64 keys always run sequentially. On an H200
#: (B=8, T=4096, H=8, K=128, bf16, η=0.003) the parallel kernel alone is faster (0.126 ms of GPU work,
#: 0.35–0.63 ms of wall time depending on the host, against 0.84 ms), but the OSDN layer's forward is
#: not (2.37 vs 2.07 ms; DeltaNet 1.77 ms): its ten launches cost host time in a forward that is
#: already bound by launches.
#: ``benchmarks/bench_phase1.py`` and ``bench_layers.py`` time both. Layers choose per instance with
#: ``phase1_method=``.
AUTO_METHOD = "sequential"
METHODS = ("auto", "sequential", "parallel")


def _resolve_method(method: str, k: torch.Tensor) -> str:
    if method not in METHODS:
        raise ValueError(f"argument 'method': expected one of {', '.join(METHODS)}, got {method!r}")
    if method == "auto":
        return "sequential" if k.dtype == torch.float64 else AUTO_METHOD
    if method == "parallel" and k.dtype == torch.float64:
        raise ValueError(f"argument 'method': the {method} kernel computes in fp32; fp64 keys need 'sequential'")
    return method


def phase1_fwd(k, beta, retention, d0, cu_seqlens, N, eta, d_min, d_max, beta_aware, eps, store_d,
               method: str = "sequential"):
    """Launch the forward kernel (``method``: ``"sequential"`` or ``"parallel"``);
    returns ``(write_key, d trajectory or None, d_final)``."""
    if method == "parallel":
        from .phase1_parallel import parallel_fwd

        return parallel_fwd(k, beta, retention, d0, cu_seqlens, N, eta, d_min, d_max, beta_aware, eps, store_d)
    return sequential_fwd(k, beta, retention, d0, cu_seqlens, N, eta, d_min, d_max, beta_aware, eps, store_d)


def phase1_bwd(k, beta, retention, dt, cu_seqlens, N, eta, d_min, d_max, beta_aware, eps,
               dwk, ddt, ddfin):
    """Launch the reverse sweep; returns ``(dk, dbeta or None, dretention or None, dd0 [N, H, K])``."""
    B, T, H, K = k.shape
    acc = dt.dtype
    # The kernels index every tensor as contiguous: incoming gradients often are not (expand, slice).
    k, beta, retention, dt, dwk, ddt, ddfin = map(_contig, (k, beta, retention, dt, dwk, ddt, ddfin))
    dwk = torch.zeros_like(k) if dwk is None else dwk
    dk = torch.empty_like(k)
    dbeta = torch.empty_like(beta) if beta_aware else None
    dr = None if retention is None else torch.empty_like(retention)
    dd0 = torch.empty(N, H, K, dtype=acc, device=k.device)
    dummy = k.new_empty(1, dtype=acc)
    osdn_phase1_bwd_kernel[(N * H,)](
        k, beta,
        dummy if retention is None else retention,
        dt, _params(eta, eps, d_min, d_max, dtype=acc, device=k.device),
        dummy if cu_seqlens is None else cu_seqlens,
        dwk, dummy if ddt is None else ddt, dummy if ddfin is None else ddfin,
        dk, dummy if dbeta is None else dbeta, dummy if dr is None else dr, dd0,
        T, H=H, K=K, BK=triton.next_power_of_2(K),
        RET=_ret_mode(retention), BOX=d_min is not None, BETA_AWARE=bool(beta_aware),
        HAS_DDT=ddt is not None, HAS_DDFIN=ddfin is not None, VARLEN=cu_seqlens is not None,
        num_warps=NUM_WARPS,
    )
    return dk, dbeta, dr, dd0


class OSDNPhase1Function(torch.autograd.Function):
    """Differentiable phase 1: ``(k, beta, retention, d0) → (write_key, d trajectory, d_final)``."""

    @staticmethod
    def forward(ctx, k, beta, retention, d0, cu_seqlens, N, eta, d_min, d_max, beta_aware, eps, method):
        k, beta, retention, d0 = map(_contig, (k, beta, retention, d0))
        wk, dt, dfin = phase1_fwd(k, beta, retention, d0, cu_seqlens, N, eta, d_min, d_max,
                                  beta_aware, eps, store_d=True, method=method)
        ctx.save_for_backward(k, beta, retention, dt, cu_seqlens)
        ctx.args = (N, eta, d_min, d_max, beta_aware, eps)
        ctx.d0_meta = None if d0 is None else (d0.dim(), d0.dtype)
        # Unused outputs (the trajectory, d_final) get None, not zeros: the kernel skips them.
        ctx.set_materialize_grads(False)
        return wk, dt, dfin

    @staticmethod
    def backward(ctx, dwk, ddt, ddfin):
        k, beta, retention, dt, cu_seqlens = ctx.saved_tensors
        N, eta, d_min, d_max, beta_aware, eps = ctx.args
        dk, dbeta, dr, dd0 = phase1_bwd(k, beta, retention, dt, cu_seqlens, N, eta, d_min, d_max,
                                        beta_aware, eps, dwk, ddt, ddfin)
        if dbeta is None and ctx.needs_input_grad[1]:
            dbeta = torch.zeros_like(beta)  # β does not enter when beta_aware=False
        if ctx.d0_meta is None:
            dd0 = None
        else:
            dim, dtype = ctx.d0_meta
            dd0 = (dd0.sum(0) if dim == 2 else dd0).to(dtype)
        return dk, dbeta, dr, dd0, None, None, None, None, None, None, None, None


def osdn_precondition(
    k: torch.Tensor,
    beta: torch.Tensor,
    *,
    retention: torch.Tensor | None = None,
    d0: torch.Tensor | None = None,
    eta: float = 0.003,
    d_min: float | None = 0.5,
    d_max: float | None = 2.0,
    beta_aware: bool = True,
    eps: float = 1e-6,
    cu_seqlens: torch.LongTensor | None = None,
    return_trajectory: bool = False,
    validate: bool = True,
    method: str = "auto",
) -> torch.Tensor | Phase1Result:
    """OSDN phase 1 on the GPU (Triton): the write keys ``k̃_t = d_t ⊙ k_t`` for phase 2.

    Same arguments and semantics as :func:`osdn_diag.math.phase1.osdn_phase1` (which see), and
    differentiable in ``k``, ``beta``, ``retention`` and ``d0``.

    Returns:
        ``k̃`` ``[B, T, H, K]`` in ``k``'s dtype; with ``return_trajectory=True`` a
        :class:`~osdn_diag.math.phase1.Phase1Result` ``(write_key, d [B, T, H, K], d_final [N, H, K])``
        with ``d`` and ``d_final`` in fp32 (fp64 for fp64 keys). Gradients flow from all three.
    Extra argument:
        validate: run the reference's argument checks (shapes, finiteness, box, d0 inside the box).
            They read every input once and synchronise with the device; ``False`` skips them (hot
            loops that already validated their inputs) — the kernel then trusts its inputs, except
            for ``cu_seqlens``' dtype, shape and device, which are checked either way.
        method: the forward kernel — ``"sequential"`` (token by token), ``"parallel"`` (Picard
            rounds over whole sequences, :mod:`osdn_diag.ops.phase1_parallel`; not for fp64) or
            ``"auto"`` (:data:`AUTO_METHOD`). Both give the same trajectory up to rounding; the
            backward is the same reverse sweep over it.

    Raises ``RuntimeError`` for CPU tensors when the kernels were not built for Triton's
    interpreter (``TRITON_INTERPRET=1`` unset when this module was imported).
    """
    method = _resolve_method(method, k)
    if validate:
        _, N = _validate(k, beta, retention, d0, eta, d_min, d_max, eps, cu_seqlens, device=k.device)
        if k.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"argument 'k': expected fp16, bf16, fp32 or fp64, got {k.dtype}")
        if k.shape[-1] > MAX_K:
            raise ValueError(
                f"argument 'k': the kernel keeps d in registers and supports K <= {MAX_K}, "
                f"got K = {k.shape[-1]}; use osdn_diag.math.osdn_phase1"
            )
        for name, x in (("beta", beta), ("retention", retention), ("d0", d0), ("cu_seqlens", cu_seqlens)):
            if x is not None and x.device != k.device:
                raise ValueError(f"argument {name!r}: expected a tensor on {k.device}, got {x.device}")
    elif cu_seqlens is None:
        N = k.shape[0]
    else:
        # Not its values (that would wait for the device), but what the kernels' pointer needs.
        N = check_cu_seqlens_layout(cu_seqlens, k.shape[0], k.device)
    check_launchable("osdn_precondition", k.device, osdn_phase1_fwd_kernel)
    args = (N, eta, d_min, d_max, beta_aware, eps)
    tensors = (k, beta, retention, d0)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        wk, dt, dfin = OSDNPhase1Function.apply(k, beta, retention, d0, cu_seqlens, *args, method)
    else:
        wk, dt, dfin = phase1_fwd(k, beta, retention, d0, cu_seqlens, *args,
                                  store_d=return_trajectory, method=method)
    if return_trajectory:
        return Phase1Result(write_key=wk, d=dt, d_final=dfin)
    return wk
