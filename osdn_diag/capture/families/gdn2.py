"""Capture of fla 0.6.0's Gated DeltaNet-2 layer (``fla.layers.gdn2.GatedDeltaNet2``): ``chunk_gdn2`` and
``fused_recurrent_gdn2``.

GDN-2 decays the state per key channel (as KDA), erases along ``b ⊙ k`` with a channel-wise erase gate
``b ∈ [0, 1]^K`` (``[0, 2]^K`` with ``allow_neg_eigval``) and writes ``w ⊙ v`` with a channel-wise
write gate ``w ∈ [0, 1]^V``. In the ``V×K`` convention, as the kernels run it:

    S̄ = S_{t−1} Diag(α_t),  u_t = w_t ⊙ v_t − S̄ (b_t ⊙ k_t),  S_t = S̄ + u_t k_tᵀ

— exactly the delta rule of the package's record with read key ``b ⊙ k``, target ``w ⊙ v``, β ≡ 1,
write key ``k`` and KDA's channel gate, in the same order (the residual after the decay). So it is
recorded in that form and replayed by the delta-rule replays (torch and Triton); no replay of its own
is registered. Onto the record (family ``"gdn2"``):

* ``k`` ← ``b ⊙ k̂`` (fp32 product, as both kernels form it in registers), ``write_key`` ← ``k̂``,
  ``v`` ← ``w ⊙ v`` (fp32), ``beta`` ← ones, ``g`` ← the channel log decay ``[B, T, HV, K]``
  (KDA's in-kernel gate reproduced where ``use_gate_in_kernel``), ``q`` ← ``q̂``;
* ``k̂, q̂``: with ``use_qk_l2norm_in_kernel``, ``l2norm_fwd``'s output in the input dtype on the
  chunk path, the fp32 register norm on the fused recurrent path;
* ``extra["b"]``, ``extra["w"]``: the raw gates as the kernel received them (fp32), for readers
  that want the plain key or value back (``k̂ = write_key``, ``v = v / w`` where ``w > 0``);
* states transposed from fla's ``K×V`` unless ``state_v_first``; query/key heads expanded to the
  value heads (``HV > H``).

Continuous batching (``ssm_state_indices``) and context parallelism (``cp_context``) are refused.
"""

from __future__ import annotations

import torch

from ..adapters import Canonical, KDAAdapter, KernelSite, _expand_heads, _scale

__all__ = ["GDN2Adapter", "SITES"]


class GDN2Adapter(KDAAdapter):
    """``chunk_gdn2`` (``path="chunk"``) and ``fused_recurrent_gdn2`` (``"fused_recurrent"``); the
    channel gate (and its in-kernel form) is KDA's."""

    family = "gdn2"

    def _refuse(self, kw: dict) -> None:
        kernel = "chunk_gdn2" if self.path == "chunk" else "fused_recurrent_gdn2"
        for name in ("ssm_state_indices", "num_accepted_tokens", "cp_context"):
            if kw.get(name) is not None:
                raise ValueError(f"{kernel}: argument {name!r} (continuous batching / context parallel) "
                                 "is not supported by the GDN-2 capture adapter")

    def canonical(self, kw: dict, *, fla: bool) -> Canonical:
        self._refuse(kw)
        v = kw["v"].float()
        hv = v.shape[2]
        q, k, read_as = self._qk(kw, fla=fla)
        q, k = _expand_heads(q, hv), _expand_heads(k, hv)
        b, w = kw["b"].float(), kw["w"].float()
        return Canonical(
            q=q, k=b * k, v=w * v, beta=torch.ones_like(v[..., 0]), g=self.gate(kw, fla=fla),
            write_key=k, scale=_scale(kw, k.shape[-1]),
            initial_state=self._initial_state(kw), cu_seqlens=kw.get("cu_seqlens"), qk_read_as=read_as,
        )

    def record(self, kw, out, **where):
        call = super().record(kw, out, **where)
        call.extra = {"b": kw["b"].detach().float(), "w": kw["w"].detach().float()}
        return call

    def flags(self, kw):
        flags = super().flags(kw)
        if "safe_gate" in kw and isinstance(kw["safe_gate"], bool):
            flags["safe_gate"] = kw["safe_gate"]
        return flags


SITES = (
    KernelSite("fla.layers.gdn2", "chunk_gdn2", GDN2Adapter("chunk")),
    KernelSite("fla.layers.gdn2", "fused_recurrent_gdn2", GDN2Adapter("fused_recurrent")),
)
