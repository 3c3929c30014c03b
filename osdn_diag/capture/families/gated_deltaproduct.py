"""fla 0.6.0's ``GatedDeltaProduct`` layer: ``n`` delta-rule micro-steps per token, one gate per token.

The layer (``fla/layers/gated_deltaproduct.py``) projects ``n = num_householder`` keys, values and βs
per token and lays them out as a sequence ``n`` times longer: micro-step ``j`` of token ``t`` is row
``t·n + j``. Its two paths:

* ``chunk_gated_delta_product(q [B, T, H, K], k [B, T·n, H, K], v [B, T·n, H, V], g [B, T, H],
  beta [B, T·n, H], num_householder=n, use_qk_l2norm_in_kernel=True, cu_seqlens (tokens))``: q and k
  are normalised with fla's ``l2norm_fwd`` (stored in the input dtype, so bf16-rounded for a bf16
  model), the gate is placed on micro-step 0 of each token (zeros on the others) and the query on the
  last micro-step; ``o: [B, T, H]``, state ``K×V``;
* ``fused_recurrent_gated_delta_rule`` (at most 64 tokens at inference), called by the layer on the
  interleaved sequence itself: ``q`` zero except on the last micro-step, ``g`` zero except on
  micro-step 0, ``cu_seqlens · n``; q and k normalised in fp32 registers; ``o: [B, T·n, H, V]``
  (the layer keeps the last micro-step's).

Either way the recurrence is *exactly* a gated delta rule on the interleaved sequence, so the record
is that sequence in the delta-rule form — ``q, k, v, beta, g`` of length ``T·n`` (the chunk path's
``q`` and ``g`` interleaved as the kernel places them, its output ``o`` on the last micro-step and
zero elsewhere), ``cu_seqlens · n`` — with ``flags["micro_steps"] = n``: replay then reports one row
per (token, micro-step) with ``pos`` the token's position (docs/families.md).
"""

from __future__ import annotations

import sys

import torch

from ...math.family_gated_deltaproduct import gated_deltaproduct_recurrence
from ..adapters import Adapter, Canonical, GatedDeltaRuleAdapter, KernelSite, _scale

__all__ = ["FAMILY", "GDPChunkAdapter", "GDPFusedAdapter", "SITES", "interleave"]

FAMILY = "gated_delta_product"
_LAYER_MODULE = "fla.layers.gated_deltaproduct"


def interleave(x: torch.Tensor | None, n: int, at: int) -> torch.Tensor | None:
    """A token tensor ``[B, T, H, ·]`` (or ``[B, T, H]``) spread over ``n`` micro-steps per token, at
    micro-step ``at`` (``-1``: the last), zeros elsewhere: ``[B, T·n, H, ·]`` — as fla places the
    query (last micro-step) and the gate (micro-step 0)."""
    if x is None:
        return None
    B, T = x.shape[:2]
    out = x.new_zeros(B, T, n, *x.shape[2:])
    out[:, :, at] = x
    return out.reshape(B, T * n, *x.shape[2:])


class GDPChunkAdapter(Adapter):
    """``chunk_gated_delta_product``, recorded as the gated delta rule it runs on micro-steps."""

    family = FAMILY

    def __init__(self):
        super().__init__("chunk")

    def canonical(self, kw: dict, *, fla: bool) -> Canonical:
        n = int(kw["num_householder"])
        q, k, read_as = self._qk(kw, fla=fla)  # l2norm_fwd: stored in the input dtype
        g = kw.get("g")
        cu = kw.get("cu_seqlens")
        return Canonical(
            q=interleave(q, n, -1), k=k, v=kw["v"].float(), beta=kw["beta"].float(),
            g=interleave(None if g is None else g.float(), n, 0),
            scale=_scale(kw, k.shape[-1]),
            initial_state=self._initial_state(kw),
            cu_seqlens=None if cu is None else cu * n,
            qk_read_as=read_as,
        )

    def record(self, kw, out, **where):
        call = super().record(kw, out, **where)
        # The kernel's o is per token: it is the read-out at each token's last micro-step.
        call.o = interleave(call.o, int(kw["num_householder"]), -1)
        return call

    def flags(self, kw: dict) -> dict:
        return {**super().flags(kw), "micro_steps": int(kw["num_householder"])}

    def reference(self, kw: dict):
        """The kernel's return value ``(o [B, T, H, V] in v's dtype, final state K×V or None)`` from
        the family's fp32 reference, on what the kernel reads (q, k after ``l2norm_fwd``)."""
        n = int(kw["num_householder"])
        q, k, _ = self._qk(kw, fla=False)
        g = kw.get("g")
        res = gated_deltaproduct_recurrence(
            q, k, kw["v"].float(), kw["beta"].float(), n,
            g=None if g is None else g.float(), scale=_scale(kw, k.shape[-1]),
            initial_state=self._initial_state(kw), cu_seqlens=kw.get("cu_seqlens"), dtype=torch.float32,
        )
        final = None
        if kw.get("output_final_state", False):
            final = res.final_state.transpose(-1, -2).contiguous()
        return res.o.to(kw["v"].dtype), final


def calling_layer_micro_steps(max_depth: int = 16) -> int:
    """``num_householder`` of the ``GatedDeltaProduct`` layer whose forward is calling the kernel.

    The layer calls ``fused_recurrent_gated_delta_rule`` on the interleaved sequence without saying
    how many micro-steps a token has; capture only records calls made inside a layer's forward, so
    the layer is on the call stack."""
    from fla.layers.gated_deltaproduct import GatedDeltaProduct

    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, GatedDeltaProduct):
            return int(owner.num_householder)
        frame = frame.f_back
    raise RuntimeError(
        "fused_recurrent_gated_delta_rule was called from fla.layers.gated_deltaproduct outside a "
        "GatedDeltaProduct forward: its number of micro-steps per token is unknown"
    )


class GDPFusedAdapter(GatedDeltaRuleAdapter):
    """``fused_recurrent_gated_delta_rule`` as the ``GatedDeltaProduct`` layer calls it: already the
    interleaved gated delta rule; the record adds the layer's number of micro-steps."""

    family = FAMILY

    def __init__(self):
        super().__init__("fused_recurrent")

    def gate(self, kw, *, fla: bool = False):
        # The layer passes g = None without a forget gate (GatedDeltaNet always passes one).
        return None if kw.get("g") is None else super().gate(kw, fla=fla)

    def record(self, kw, out, **where):
        call = super().record(kw, out, **where)
        n = calling_layer_micro_steps()
        if call.k.shape[1] % n:
            raise RuntimeError(
                f"layer {call.layer} ({call.layer_name}, kernel {call.kernel}): {call.k.shape[1]} "
                f"micro-steps are not a whole number of tokens of {n}"
            )
        call.flags["micro_steps"] = n
        return call


SITES = (
    KernelSite(_LAYER_MODULE, "chunk_gated_delta_product", GDPChunkAdapter()),
    KernelSite(_LAYER_MODULE, "fused_recurrent_gated_delta_rule", GDPFusedAdapter()),
)
