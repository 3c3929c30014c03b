"""fla 0.6.0's momentum delta rule (``MomentumDeltaNet``): ``chunk_momentum_delta_rule`` and
``fused_recurrent_momentum_delta_rule``.

Both entry points do the same before their recurrence (fla 0.6.0, ``fla/ops/momentum_delta_rule``):

* with ``use_qk_l2norm_in_kernel`` (the layer's default), q, k and p are normalised by fla's
  ``l2norm_fwd`` and stored in the input dtype;
* the write key ``k̃ = η ⊙ k`` is formed in fp32 and stored in the input dtype;
* the residual key ``p̃ = exp(log_alpha) ⊙ p`` (``use_p_times_alpha``, the default; ``p`` itself
  otherwise) likewise;
* the recurrence (:mod:`osdn_diag.math.family_momentum_delta_rule`) then runs in fp32 on those
  stored tensors, with ``α = exp(log_alpha)``, ``μ = exp(log_mu)`` and β as given.

The state ``[S, M]`` is passed and returned stacked, ``[2, N, H, K, V]`` (K×V); the record keeps S in
``initial_state`` / ``final_state`` (V×K) and the momentum buffer in ``extra["initial_momentum"]`` /
``extra["final_momentum"]`` (``[N, H, V, K]``), beside the per-token ``extra["residual_key"]``
(p̃, ``[B, T, H, K]``) and ``extra["log_mu"]`` (``[B, T, H]``). ``k`` is the normalised key (the loss
key), ``write_key`` k̃, ``g`` log α.

In fla 0.6.0 both "kernels" are torch code (the fused recurrent one a token loop, the chunk one a
chunked closed form); neither takes ``cu_seqlens``, and the chunk one refuses fp32 inputs.
"""

from __future__ import annotations

import torch

from ...math.family_momentum_delta_rule import momentum_delta_rule_recurrence
from .. import kernel_inputs as ki
from ..adapters import Adapter, Canonical, KernelSite, _dtype_name, _scale

__all__ = ["FAMILY", "MomentumDeltaRuleAdapter", "SITES"]

FAMILY = "momentum_delta_rule"


class MomentumDeltaRuleAdapter(Adapter):
    """``chunk_momentum_delta_rule`` / ``fused_recurrent_momentum_delta_rule`` (both store q, k, p
    normalised in the input dtype)."""

    family = FAMILY

    def __init__(self, path: str = "chunk"):
        super().__init__(path, stores_qk=True)

    def _states(self, kw: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        h0 = kw.get("initial_state")
        if h0 is None:
            return None, None
        # fla reads initial_state[0] (S) and initial_state[1] (M), each [N, H, K, V].
        return h0[0].float().transpose(-1, -2), h0[1].float().transpose(-1, -2)

    def tensors(self, kw: dict, *, fla: bool) -> dict:
        """What the recurrence reads, fp32: q, k (normalised), v, beta, g, log_mu, write_key, residual_key."""
        dt = kw["q"].dtype
        q, k = kw["q"], kw["k"]
        p = kw.get("p")
        p = k if p is None else p
        if kw.get("use_qk_l2norm_in_kernel", True):
            q, k, p = (ki.l2norm_stored(x, fla=fla) for x in (q, k, p))
        else:
            q, k, p = q.float(), k.float(), p.float()
        lead = kw["q"].shape[:-1]
        beta = kw.get("beta")
        eta = kw.get("eta")
        beta = torch.ones(lead, device=k.device) if beta is None else beta.float()
        eta = torch.ones(lead, device=k.device) if eta is None else eta.float()
        log_alpha = kw["log_alpha"].float()
        # The products are formed as torch promotes them (fp32 for the layer's fp32 η and log α) and
        # stored in the inputs' dtype before the recurrence reads them.
        eta_in = kw.get("eta")
        write_key = (k.to(dt) * (eta if eta_in is None else eta_in)[..., None]).to(dt).float()
        if kw.get("use_p_times_alpha", True):
            residual_key = (p.to(dt) * kw["log_alpha"].exp()[..., None]).to(dt).float()
        else:
            residual_key = p
        return dict(q=q, k=k, v=kw["v"].float(), beta=beta, g=log_alpha, log_mu=kw["log_mu"].float(),
                    write_key=write_key, residual_key=residual_key)

    def canonical(self, kw, *, fla):
        t = self.tensors(kw, fla=fla)
        S0, _ = self._states(kw)
        return Canonical(
            q=t["q"], k=t["k"], v=t["v"], beta=t["beta"], g=t["g"], write_key=t["write_key"],
            scale=_scale(kw, t["k"].shape[-1]), initial_state=S0, cu_seqlens=kw.get("cu_seqlens"),
            qk_read_as=_dtype_name(kw["k"]),
        )

    def record(self, kw, out, **where):
        call = super().record(kw, out, **where)
        t = self.tensors(kw, fla=where.get("fla", False))
        _, M0 = self._states(kw)
        call.extra = {"residual_key": t["residual_key"], "log_mu": t["log_mu"]}
        if M0 is not None:
            call.extra["initial_momentum"] = M0
        h = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if h is not None:
            call.extra["final_momentum"] = h[1].detach().float().transpose(-1, -2)
        if "chunk_size" in kw:
            call.flags["chunk_size"] = int(kw["chunk_size"])
        return call

    def final_state(self, out, kw):
        h = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        return None if h is None else h[0].detach().float().transpose(-1, -2)

    def flags(self, kw):
        return {n: bool(kw.get(n, True)) for n in ("use_qk_l2norm_in_kernel", "use_p_times_alpha")}

    def reference(self, kw):
        """The kernel's ``(o, [S, M] or None)`` by the fp32 reference recurrence."""
        t = self.tensors(kw, fla=False)
        S0, M0 = self._states(kw)
        res = momentum_delta_rule_recurrence(
            t["q"], t["k"], t["v"], t["beta"], t["g"], t["log_mu"],
            write_key=t["write_key"], residual_key=t["residual_key"], scale=_scale(kw, t["k"].shape[-1]),
            initial_state=S0, initial_momentum=M0, cu_seqlens=kw.get("cu_seqlens"),
            dtype=torch.float32, allow_nonfinite=True,
        )
        final = None
        if kw.get("output_final_state", False):
            final = torch.stack([res.final_state.transpose(-1, -2), res.final_momentum.transpose(-1, -2)]).contiguous()
        return res.o.to(kw["v"].dtype), final


SITES = (
    KernelSite("fla.layers.momentum_deltanet", "chunk_momentum_delta_rule", MomentumDeltaRuleAdapter("chunk")),
    KernelSite("fla.layers.momentum_deltanet", "fused_recurrent_momentum_delta_rule",
               MomentumDeltaRuleAdapter("fused_recurrent")),
)
