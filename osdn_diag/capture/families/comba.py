"""Capture of fla 0.6.0's Comba layer (``fla.layers.comba.Comba``): ``chunk_comba`` and
``fused_recurrent_comba``.

Comba removes along an auxiliary key ``p`` and writes along ``k``, with the residual taken against
the state before the token's decay (:mod:`osdn_diag.math.family_comba`). The record maps the kernel
onto the canonical fields as follows (family ``"comba"``, replayed by
:mod:`osdn_diag.replay.families.comba`):

* ``k`` ← ``p`` as the recurrence read it: the key the residual and the loss read (so
  ``key_sqnorm`` is ‖p‖²);
* ``write_key`` ← ``k`` as the recurrence read it: the key the write is made along;
* ``q``, ``v``, ``beta``, ``g`` (the head log decay, fp32 as the layer passes it), the states
  transposed from fla's ``K×V`` to ``V×K``; grouped value heads (``HV > H``) expanded.

With ``use_qk_l2norm_in_kernel`` both kernels normalise q, k *and* p: the chunk path stores them
with ``l2norm_fwd`` in the input dtype, the fused recurrent kernel keeps them in fp32 registers.
fla's layer passes ``p = k·sigmoid(decay)``; the normalisation's ε (``x / √(‖x‖² + 1e-6)``) then
makes ``p`` a shorter copy of ``k``, ``p̂ = c·k̂`` with ``c < 1`` (far below 1 for small keys and a
negative inner decay), so the two are recorded apart; a direct call may pass any ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...math.family_comba import comba_recurrence
from ..adapters import Adapter, KernelSite, _dtype_name, _expand_heads, _scale
from .. import kernel_inputs as ki
from ..record import KernelCall

__all__ = ["CombaAdapter", "SITES"]

FAMILY = "comba"


class CombaAdapter(Adapter):
    """``chunk_comba`` (``path="chunk"``) and ``fused_recurrent_comba`` (``"fused_recurrent"``)."""

    family = FAMILY

    def _keys(self, kw: dict, *, fla: bool):
        """``(q, p, k, dtype read)``: the three vectors as the recurrence reads them (fp32)."""
        q, k = kw["q"], kw["k"]
        p = kw.get("p")
        if p is None:  # both entry points default p to k
            p = k
        if not kw.get("use_qk_l2norm_in_kernel", False):
            return q.float(), p.float(), k.float(), _dtype_name(k)
        if self.stores_qk:
            return (ki.l2norm_stored(q, fla=fla), ki.l2norm_stored(p, fla=fla),
                    ki.l2norm_stored(k, fla=fla), _dtype_name(k))
        return ki.l2norm_in_registers(q), ki.l2norm_in_registers(p), ki.l2norm_in_registers(k), "float32"

    def canonical(self, kw: dict, *, fla: bool):
        v = kw["v"].float()
        hv = v.shape[2]
        beta = kw.get("beta")
        if beta is not None and beta.dim() == 4:
            raise ValueError(
                "fused_recurrent_comba: a per-value-channel beta ([B, T, HV, V]) is not supported by the "
                "Comba adapter; it records one beta per head and token"
            )
        beta = torch.ones_like(v[..., 0]) if beta is None else beta.float()
        q, p, k, read_as = self._keys(kw, fla=fla)
        g = kw.get("g")
        return _Canonical(
            q=_expand_heads(q, hv), p=_expand_heads(p, hv), k=_expand_heads(k, hv), v=v, beta=beta,
            g=None if g is None else g.float(), scale=_scale(kw, k.shape[-1]),
            initial_state=self._initial_state(kw), cu_seqlens=kw.get("cu_seqlens"), qk_read_as=read_as,
        )

    def record(self, kw, out, *, layer, layer_name, kernel, fla=False) -> KernelCall:
        c = self.canonical(kw, fla=fla)
        flags = self.flags(kw)
        flags["path"] = self.path
        flags["qk_read_as"] = c.qk_read_as
        return KernelCall(
            layer=layer, layer_name=layer_name, family=self.family, kernel=kernel,
            q=c.q, k=c.p, v=c.v, beta=c.beta, g=c.g, write_key=c.k,
            initial_state=c.initial_state, final_state=self.final_state(out, kw), cu_seqlens=c.cu_seqlens,
            o=self.output(out).detach().float(), scale=c.scale,
            input_dtype=_dtype_name(kw["q"]), flags=flags,
        )

    def reference(self, kw: dict):
        """The kernel's ``(o, final_state)`` by the fp32 Comba reference (fla's roundings emulated)."""
        c = self.canonical(kw, fla=False)
        res = comba_recurrence(
            c.q, c.p, c.k, c.v, c.beta, g=c.g, scale=c.scale, initial_state=c.initial_state,
            cu_seqlens=c.cu_seqlens, dtype=torch.float32, allow_nonfinite=True,
        )
        final = None
        if kw.get("output_final_state", False):
            final = res.final_state.transpose(-1, -2).contiguous()  # fla's K×V layout
        return res.o.to(kw["v"].dtype), final


@dataclass(frozen=True)
class _Canonical:
    """Comba's inputs in the package's conventions (fp32, ``[B, T, HV, ·]``, state ``V×K``)."""

    q: torch.Tensor
    p: torch.Tensor  # the removal (read) key
    k: torch.Tensor  # the write key
    v: torch.Tensor
    beta: torch.Tensor
    g: torch.Tensor | None
    scale: float
    initial_state: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    qk_read_as: str


SITES = (
    KernelSite("fla.layers.comba", "chunk_comba", CombaAdapter("chunk")),
    KernelSite("fla.layers.comba", "fused_recurrent_comba", CombaAdapter("fused_recurrent")),
)
