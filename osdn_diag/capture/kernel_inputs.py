"""What an fla kernel actually reads: its inputs after the transforms fla applies before or inside it.

fla 0.6.0 transforms some inputs in a separate step whose result is *stored* and then read by the
recurrence, and others in registers inside the recurrence kernel. The two differ in rounding: a stored
result has the input's dtype (bf16 for a bf16 model), a register value is fp32. The record must hold
what the recurrence read, bit for bit where it was stored, so each transform here comes in two forms:

* ``fla=True`` — call fla's own function on the kernel's arguments. fla's kernels are deterministic
  and autotuned per shape once, so the same call on the same tensors reproduces the stored tensor
  bit for bit. Used whenever fla's kernel ran (on a GPU, or on a CPU under Triton's interpreter).
* ``fla=False`` — the same arithmetic in torch, rounded to the same dtype at the same place. Used when
  the package's reference recurrence stands in for the kernel (``capture(kernels="reference")``), so
  the stand-in reads what fla would have read.

Where a path keeps a value in registers (the fused recurrent kernels), the fp32 form is used and the
record says so (``KernelCall.flags["qk_read_as"]``). docs/fla-0.6.0-callsites.md lists, path by path,
what is rounded where.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "L2NORM_EPS",
    "beta_sigmoid",
    "gdn_gate",
    "kda_gate",
    "l2norm_in_registers",
    "l2norm_stored",
    "precond_write_key_stored",
    "unit_roundoff",
]

L2NORM_EPS = 1e-6


def l2norm_in_registers(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(Σx² + 1e-6)`` in fp32, as the fused recurrent kernels compute it in registers."""
    x = x.float()
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def l2norm_stored(x: torch.Tensor, *, fla: bool) -> torch.Tensor:
    """fla's ``l2norm_fwd(x)``: the l2-normalised ``x`` stored in ``x``'s dtype, returned as fp32.

    The chunk paths (and DeltaNet's fused recurrent path) normalise q and k with this function before
    the recurrence reads them, so for a bf16 model the keys the recurrence reads are bf16-rounded
    unit vectors (``‖k‖²`` within about ``2^-8`` of 1, not 1).
    """
    if fla:
        from fla.modules.norm.l2norm import l2norm_fwd

        return l2norm_fwd(x.contiguous())[0].float()
    xf = x.float()
    # The kernel's order of operations: rstd = 1 / sqrt(Σx² + eps), then x · rstd, then the store.
    rstd = 1.0 / torch.sqrt(xf.square().sum(-1, keepdim=True) + L2NORM_EPS)
    return (xf * rstd).to(x.dtype).float()


def beta_sigmoid(beta: torch.Tensor, scale: float, *, fla: bool) -> torch.Tensor:
    """``scale · sigmoid(beta)`` in fp32 (fla's ``fused_beta_sigmoid`` stores fp32; the fused
    recurrent kernels compute the same in registers)."""
    if fla:
        from fla.ops.common.gate import fused_beta_sigmoid_fwd

        return fused_beta_sigmoid_fwd(beta.contiguous(), scale)
    return beta.float().sigmoid() * scale


def gdn_gate(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None, *, fla: bool) -> torch.Tensor:
    """Gated DeltaNet's per-token log decay ``−exp(A_log)·softplus(a + dt_bias)``, ``[B, T, HV]``, fp32."""
    if fla:
        from fla.ops.gated_delta_rule.gate import gdn_gate_fwd

        return gdn_gate_fwd(a.contiguous(), A_log.contiguous(),
                            None if dt_bias is None else dt_bias.contiguous())
    x = a.float() if dt_bias is None else a.float() + dt_bias.float()
    return -A_log.float().exp() * F.softplus(x)


def kda_gate(
    a: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    *,
    fla: bool,
) -> torch.Tensor:
    """KDA's per-key-channel log decay, ``[B, T, HV, K]``, fp32: ``−exp(A_log)·softplus(a + dt_bias)``,
    or with ``lower_bound`` ``lower_bound·sigmoid(exp(A_log)·(a + dt_bias))``."""
    if fla:
        from fla.ops.kda.gate import kda_gate_fwd

        return kda_gate_fwd(
            a.contiguous(),
            None if A_log is None else A_log.contiguous(),
            None if dt_bias is None else dt_bias.contiguous(),
            lower_bound,
        )
    hv, K = a.shape[2], a.shape[3]
    x = a.float() if dt_bias is None else a.float() + dt_bias.float().view(hv, K)
    if lower_bound is None:
        return -A_log.float().exp().view(hv, 1) * F.softplus(x)
    if A_log is not None:
        x = A_log.float().exp().view(hv, 1) * x
    return lower_bound * x.sigmoid()


def precond_write_key_stored(
    k_stored: torch.Tensor,
    d: torch.Tensor,
    kw: dict,
    *,
    fla: bool,
) -> torch.Tensor:
    """The write key ``k_precond = d ⊙ k`` of fla's preconditioned chunk paths, as ``chunk_atk_fwd``
    stores it (in the keys' dtype), returned as fp32.

    Args:
        k_stored: the normalised keys exactly as the chunk path stored them (``l2norm_fwd``'s output,
            in the input dtype), ``[B, T, H, K]`` on the accumulator's heads.
        d: the preconditioner computed in fp32 by :func:`osdn_diag.capture.adapters.precond_accumulator`
            (used by the ``fla=False`` form only).
        kw: the kernel's arguments (``g_atk``, ``beta_atk``, ``initial_A_state``, ``cu_seqlens``,
            ``x``, ``eps``, ``log_atk_scale``).
    """
    if fla:
        from fla.ops.atk.chunk_atk_fwd import chunk_atk_fwd

        k_precond, _ = chunk_atk_fwd(
            k=k_stored, beta=kw["beta_atk"], log_g=kw["g_atk"], chunk_size=64,
            initial_A_state=kw.get("initial_A_state"), output_final_state=False,
            cu_seqlens=kw.get("cu_seqlens"), x=float(kw.get("x", 1.5)), eps=float(kw.get("eps", 1e-6)),
            log_atk_scale=kw.get("log_atk_scale"),
        )
        return k_precond.float()
    return (d * k_stored.float()).to(k_stored.dtype).float()


def unit_roundoff(dtype: str) -> float:
    """Half the spacing of floating-point numbers near 1 for a dtype name (``"bfloat16"`` → 2^-8)."""
    bits = {"bfloat16": 8, "float16": 11, "tfloat32": 11, "float32": 24, "float64": 53}.get(dtype, 24)
    return math.ldexp(1.0, -bits)
