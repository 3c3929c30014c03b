"""Replay of the momentum delta rule (fla's ``MomentumDeltaNet``): state and momentum recurrences.

The write at token t is ``S_t = α_t S_{t−1} − β_t (μ_t M_{t−1} + r_t k̃_tᵀ)``: it depends on the
momentum buffer, so the delta-rule replay cannot stand in. The torch reference
(:func:`osdn_diag.math.family_momentum_delta_rule.momentum_delta_rule_recurrence`) serves both
backends (``"triton"`` runs it too; there is no fused replay kernel for this family).

Besides the checks every replay gets (output and final state against the kernel's), this one checks
the momentum buffer's final value against the kernel's (``extra["final_momentum"]``), and on fla's
chunk path :data:`HINTS` explains a failed output check: that form loses accuracy when the state
decays much more slowly than the momentum within a chunk (:func:`chunk_log_span`), see
docs/families.md.
"""

from __future__ import annotations

import math

import torch

from ...capture.record import KernelCall
from ...math.family_momentum_delta_rule import MomentumResult, momentum_delta_rule_recurrence
from ..call import FidelityError, default_state_tolerance, zero_nonfinite

__all__ = ["CHUNK_SPAN_LIMIT", "COLUMNS", "HINTS", "REPLAYS", "chunk_hint", "chunk_log_span", "replay"]

FAMILY = "momentum_delta_rule"
COLUMNS: tuple[str, ...] = ()

#: Largest ``chunk_log_span`` at which fla's chunk form was measured to stay within bf16 accuracy of
#: the exact recurrence (fp32 cancellation of terms ``exp(±span)``: the error grows like
#: ``2⁻²⁴·exp(span)``; measured 3e-4 at span 6.4, O(1) at span 32). docs/families.md has the table.
CHUNK_SPAN_LIMIT = 10.0


def chunk_log_span(call: KernelCall, chunk_size: int = 64) -> float:
    """The largest, over chunks of ``chunk_size`` tokens (fla's chunking from each sequence's start),
    of ``max_j Σ_{i ≤ j in chunk} (log α_i − log μ_i)`` — how many e-folds the state's decay falls
    behind the momentum's within one chunk. fla's chunk form divides and multiplies by ``exp`` of
    these partial sums in fp32, so its error grows like ``exp(span)``."""
    diff = (call.g.double() - call.extra["log_mu"].double())  # [B, T, H]
    worst = 0.0
    for row, start, end in call.segments():
        d = diff[row, start:end]
        L = d.shape[0]
        pad = (-L) % chunk_size
        d = torch.cat([d, d.new_zeros(pad, d.shape[1])]).reshape(-1, chunk_size, d.shape[1])
        if d.numel():
            worst = max(worst, float(d.cumsum(1).amax()))
    return worst


def _masked(call: KernelCall, bad: torch.Tensor | None, name: str):
    x = call.extra[name] if name in call.extra else getattr(call, name)
    return x if bad is None or x is None else zero_nonfinite(x, bad)


def replay(call: KernelCall, *, dtype: torch.dtype, bad: torch.Tensor | None, backend: str) -> MomentumResult:
    """Recompute S and M for every token of ``call`` (both backends: the torch reference), in fp64
    whatever ``dtype``, the results returned in ``dtype``.

    fla 0.6.0's fused recurrent entry point is itself a torch loop in fp32 whose operations are the
    recurrence's, one for one: an fp32 replay would repeat its rounding exactly and its output check
    would read 0 by construction, proving nothing. In fp64 the replay is the exact recurrence up to
    ~1e-16, so the check measures the kernel's own fp32 (or chunk-form) error against the mathematics."""
    del backend  # one reference for both
    S0, M0 = call.initial_state, call.extra.get("initial_momentum")
    if bad is not None:
        S0, M0 = (None if x is None else torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0) for x in (S0, M0))
    res = momentum_delta_rule_recurrence(
        *(_masked(call, bad, n) for n in ("q", "k", "v", "beta", "g", "log_mu")),
        write_key=_masked(call, bad, "write_key"), residual_key=_masked(call, bad, "residual_key"),
        scale=call.scale, initial_state=S0, initial_momentum=M0, cu_seqlens=call.cu_seqlens, dtype=torch.float64,
    )
    res = _cast(res, dtype)
    _check_momentum(call, res, bad)
    return res


def _cast(res: MomentumResult, dtype: torch.dtype) -> MomentumResult:
    """Every tensor of ``res`` in ``dtype`` (the replay's value type)."""
    for name, value in vars(res).items():
        if isinstance(value, torch.Tensor):
            setattr(res, name, value.to(dtype))
    res.columns = {k: v.to(dtype) for k, v in res.columns.items()}
    return res


def _where(call: KernelCall) -> str:
    return (f"layer {call.layer} ({call.layer_name}, kernel {call.kernel}, "
            f"{call.flags.get('path', 'chunk')} path, {call.input_dtype} inputs)")


def _stream_ok(call: KernelCall, bad: torch.Tensor | None) -> torch.Tensor:
    """``[N, H]``: True for the (sequence, head) streams whose inputs are all finite."""
    segs = call.segments()
    if bad is None:
        return torch.ones(len(segs), call.num_heads, dtype=torch.bool, device=call.k.device)
    return torch.stack([~bad[r, s:e].any(0) for r, s, e in segs])


def chunk_hint(call: KernelCall) -> str | None:
    """For a failed output check on fla's chunk path at a large :func:`chunk_log_span`: the cause
    (fla's chunk form, not the record) and what to do; ``None`` elsewhere."""
    if call.flags.get("path") != "chunk" or call.flags.get("kernels") != "fla":
        return None
    span = chunk_log_span(call, int(call.flags.get("chunk_size", 64)))
    if span <= CHUNK_SPAN_LIMIT:
        return None
    return (
        f"fla's chunk form of the momentum delta rule is inaccurate here, not the record: the state "
        f"decays up to {span:.3g} e-folds slower than the momentum buffer within a chunk (Σ log α − log μ; "
        f"the chunk form is accurate below about {CHUNK_SPAN_LIMIT:g}). Capture this layer on its fused "
        f"recurrent path instead (MomentumDeltaNet(mode='fused_recurrent'), i.e. attn_mode='fused_recurrent' "
        f"in the model config, or prompts of at most 64 tokens); a min_log_mu closer to 0 also narrows the "
        f"span; --tolerance accepts the chunk form's error as it is"
    )


def _check_momentum(call: KernelCall, res: MomentumResult, bad) -> None:
    """The replayed momentum buffer's final value against the kernel's, per finite stream."""
    kernel_m = call.extra.get("final_momentum")
    if kernel_m is None or res.final_momentum is None or chunk_hint(call) is not None:
        return  # where fla's chunk form is known to be off, the state check says so, with the hint
    dt = res.final_momentum.dtype
    diff = (res.final_momentum - kernel_m.to(dt)).square().sum((-2, -1)).sqrt()
    norm = kernel_m.to(dt).square().sum((-2, -1)).sqrt().clamp_min(torch.finfo(dt).tiny)
    rel = torch.where(_stream_ok(call, bad), diff / norm, torch.zeros_like(diff))
    worst = float(rel.nan_to_num(nan=math.inf).amax()) if rel.numel() else 0.0
    tol = default_state_tolerance(call)
    if worst > tol:
        raise FidelityError(
            f"{_where(call)}: the replayed momentum buffer's final value differs from the kernel's by "
            f"{worst:.3g} (relative), above the tolerance {tol:.1g} — the record is not what the kernel read"
        )


REPLAYS = {FAMILY: replay}
HINTS = {FAMILY: chunk_hint}
