"""fla 0.6.0's RWKV-7 (``RWKV7Attention``): ``chunk_rwkv7`` and ``fused_mul_recurrent_rwkv7``.

Both run ``S_t = S_{t−1}(Diag(exp(w_t)) + a_t b_tᵀ) + v_t k_tᵀ`` (V×K; fla's state is ``K×V``,
``[N, H, K, V]``, transposed on capture), ``o_t = S_t (scale · r_t)``, with ``w`` a *log* decay
per key channel, as :mod:`osdn_diag.math.family_rwkv7` states:

* ``chunk_rwkv7(r, w, k, v, a, b, ...)`` is fla's chunked DPLR delta rule with ``gk = w``; the layer
  passes ``a = −κ̂`` and ``b = κ̂ ⊙ α`` (κ̂ the l2-normalised ``k ⊙ k_k``, α the sigmoid in-context
  rate), both formed by torch in the model's dtype, and ``scale = 1``;
* ``fused_mul_recurrent_rwkv7(r, w, k, v, kk, a, ...)`` takes ``κ̂ = kk`` and α = ``a`` and forms
  ``−κ̂`` and ``κ̂ ⊙ α`` itself, in fp32 registers from the stored values.

The record: ``q = r``, ``k = κ̂`` (the removal key, which the token-local loss reads; ``−a`` of the
chunk kernel), ``write_key = k`` (the key the value is written along), ``v``, ``g = w``,
``extra["b"] = κ̂ ⊙ α`` (``[B, T, H, K]``, as the recurrence read it), and ``beta = ⟨b_t, κ̂_t⟩``, the
erase's gain along κ̂ (RWKV-7 has no scalar step; this is the delta rule's ``β_t‖k_t‖²``).
Nothing is normalised or activated inside these kernels, so the record is their arguments.
"""

from __future__ import annotations

import torch

from ...math.family_rwkv7 import rwkv7_recurrence
from ..adapters import Adapter, Canonical, KernelSite, _dtype_name

__all__ = ["FAMILY", "RWKV7Adapter", "SITES"]

FAMILY = "rwkv7"


class RWKV7Adapter(Adapter):
    """``chunk_rwkv7`` (``path="chunk"``: removal key ``−a``, ``b`` given) or
    ``fused_mul_recurrent_rwkv7`` (``path="fused_recurrent"``: removal key ``kk``, ``b = kk ⊙ a``)."""

    family = FAMILY

    def __init__(self, path: str = "chunk"):
        super().__init__(path, stores_qk=False)

    def keys(self, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(removal key κ̂, b)`` in fp32, as the recurrence reads them."""
        if self.path == "chunk":
            return -kw["a"].float(), kw["b"].float()
        if kw.get("reverse", False):
            raise NotImplementedError(
                "fused_mul_recurrent_rwkv7(reverse=True) runs the recurrence backwards in time; "
                "capture records forward recurrences only"
            )
        kk = kw["kk"].float()
        return kk, kk * kw["a"].float()  # the kernel's −kk and kk·a, in fp32 registers

    def _scale_of(self, kw: dict) -> float:
        s = kw.get("scale")
        return float(kw["r"].shape[-1] ** -0.5 if s is None else s)

    def canonical(self, kw, *, fla):
        kh, b = self.keys(kw)
        return Canonical(
            q=kw["r"].float(), k=kh, v=kw["v"].float(), beta=(b * kh).sum(-1), g=kw["w"].float(),
            write_key=kw["k"].float(), scale=self._scale_of(kw), initial_state=self._initial_state(kw),
            cu_seqlens=kw.get("cu_seqlens"), qk_read_as=_dtype_name(kw["k"]),
        )

    def record(self, kw, out, **where):
        call = super().record({**kw, "q": kw["r"]}, out, **where)  # the base reads the dtype from q
        call.extra = {"b": self.keys(kw)[1]}
        return call

    def flags(self, kw):
        return {n: kw[n] for n in ("safe_gate", "lower_bound", "chunk_size")
                if isinstance(kw.get(n), (bool, int, float))}

    def reference(self, kw):
        """The kernel's ``(o, final state [N, H, K, V] or None)`` by the fp32 reference."""
        c = self.canonical(kw, fla=False)
        kh, b = self.keys(kw)
        res = rwkv7_recurrence(
            c.q, kh, b, c.write_key, c.v, c.g, scale=c.scale, initial_state=c.initial_state,
            cu_seqlens=c.cu_seqlens, dtype=torch.float32, allow_nonfinite=True,
        )
        final = res.final_state.transpose(-1, -2).contiguous() if kw.get("output_final_state", False) else None
        return res.o.to(kw["v"].dtype), final


SITES = (
    KernelSite("fla.layers.rwkv7", "chunk_rwkv7", RWKV7Adapter("chunk")),
    KernelSite("fla.layers.rwkv7", "fused_mul_recurrent_rwkv7", RWKV7Adapter("fused_recurrent")),
)
