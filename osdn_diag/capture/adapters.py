"""One adapter per fla kernel family: from the arguments a kernel received to a :class:`KernelCall`.

Each adapter reproduces what its kernel does *inside* (fla 0.6.0), so that the captured record
describes the recurrence the kernel actually ran:

* ``use_qk_l2norm_in_kernel``: ``x / sqrt(Σx² + 1e-6)`` in fp32 (eps inside the square root);
* ``scale``: ``K^{-1/2}`` unless given;
* gated delta rule (GDN layer): β = sigmoid(logit) (×2 with ``allow_neg_eigval``) when
  ``use_beta_sigmoid_in_kernel``; ``g = −exp(A_log)·softplus(a + dt_bias)`` when ``use_gate_in_kernel``;
* KDA: the same β, and the per-channel gate ``−exp(A_log)·softplus(a + dt_bias)`` or, with
  ``lower_bound``, ``lower_bound·sigmoid(exp(A_log)·(a + dt_bias))``;
* preconditioned delta rules (``precond_gated_delta_rule``, ``precond_kda``): the diagonal
  accumulator ``A_t = exp(g_atk)·A_{t−1} + β_atk·k̂⊙k̂`` (updated *before* the write, unlike OSDN),
  ``r = log(A_t + eps) − log_atk_scale``, ``d_t = x^{−r/(1+|r|)}``, write key ``d_t ⊙ k̂``;
* state layouts: every record holds the state ``V×K``; grouped value heads (``HV > H``) are expanded
  so that value head ``i`` reads key head ``i // (HV/H)``.
* the package's own OSDN / OSGDN layers (:mod:`osdn_diag.layers`): phase 1
  (``osdn_precondition``) is intercepted too, so the record holds the exact ``d_t`` the phase-1
  kernel produced for every token (not ``k̃ / k``), and phase 2 (``chunk_osdn``) is recorded like any
  other delta-rule kernel.

Each adapter can also *compute* the kernel's outputs with the reference recurrence, in the kernel's
own output format, so capture can stand in for the Triton kernel on a machine without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..math.recurrence import delta_rule_recurrence
from .record import KernelCall

__all__ = ["ADAPTERS", "Adapter", "KernelSite", "OSDNAdapter", "Phase1Site", "l2norm"]

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's in-kernel l2 norm, in fp32: ``x / sqrt(Σ x² + 1e-6)``."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def _expand_heads(x: torch.Tensor | None, hv: int) -> torch.Tensor | None:
    """Repeat key heads so that value head ``i`` reads key head ``i // (HV / H)``."""
    if x is None or x.shape[2] == hv:
        return x
    return x.repeat_interleave(hv // x.shape[2], dim=2)


def _beta(beta: torch.Tensor, kw: dict) -> torch.Tensor:
    beta = beta.float()
    if kw.get("use_beta_sigmoid_in_kernel", False):
        beta = beta.sigmoid() * (2.0 if kw.get("allow_neg_eigval", False) else 1.0)
    return beta


@dataclass(frozen=True)
class Canonical:
    """The recurrence an fla kernel ran, in the package's conventions (fp32)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    scale: float
    g: torch.Tensor | None = None
    d: torch.Tensor | None = None
    initial_state: torch.Tensor | None = None  # [N, HV, V, K]
    cu_seqlens: torch.Tensor | None = None
    extra_final: torch.Tensor | None = None    # e.g. the precond A-state at the end, kernel layout


class Adapter:
    """Base class: ``canonical(kwargs)`` and the kernel's output format."""

    family: str = ""
    returns_extra_state = False

    def canonical(self, kw: dict) -> Canonical:  # pragma: no cover - abstract
        raise NotImplementedError

    def state_is_v_first(self, kw: dict) -> bool:
        return bool(kw.get("state_v_first", False) or kw.get("transpose_state_layout", False))

    def _initial_state(self, kw: dict) -> torch.Tensor | None:
        h0 = kw.get("initial_state")
        if h0 is None:
            return None
        h0 = h0.float()
        return h0 if self.state_is_v_first(kw) else h0.transpose(-1, -2)

    def record(self, kw: dict, out, *, layer: int, layer_name: str, kernel: str) -> KernelCall:
        c = self.canonical(kw)
        o = self.output(out)
        return KernelCall(
            layer=layer,
            layer_name=layer_name,
            family=self.family,
            kernel=kernel,
            q=c.q, k=c.k, v=c.v, beta=c.beta, g=c.g, d=c.d,
            initial_state=c.initial_state,
            cu_seqlens=c.cu_seqlens,
            o=o.detach().float(),
            scale=c.scale,
            input_dtype=str(kw["q"].dtype).removeprefix("torch."),
            flags=self.flags(kw),
        )

    def output(self, out) -> torch.Tensor:
        """The kernel's output tensor ``o`` from its return value."""
        return out[0] if isinstance(out, tuple) else out

    def flags(self, kw: dict) -> dict:
        names = (
            "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
            "use_gate_in_kernel", "state_v_first", "transpose_state_layout", "lower_bound", "x", "eps",
        )
        return {n: kw[n] for n in names if n in kw and isinstance(kw[n], (bool, int, float))}

    def reference(self, kw: dict):
        """The kernel's return value, computed by the fp32 reference recurrence."""
        c = self.canonical(kw)
        res = delta_rule_recurrence(
            c.q, c.k, c.v, c.beta,
            write_key=None if c.d is None else c.d * c.k,
            g=c.g, scale=c.scale, initial_state=c.initial_state, cu_seqlens=c.cu_seqlens,
            dtype=torch.float32,
        )
        o = res.o.to(kw["v"].dtype)
        final = None
        if kw.get("output_final_state", False):
            final = res.final_state if self.state_is_v_first(kw) else res.final_state.transpose(-1, -2)
            final = final.contiguous()
        if self.returns_extra_state:
            return o, final, c.extra_final if kw.get("output_final_state", False) else None
        return o, final


def _scale(kw: dict, K: int) -> float:
    s = kw.get("scale")
    return float(K**-0.5 if s is None else s)


class DeltaRuleAdapter(Adapter):
    """``chunk_delta_rule`` / ``fused_recurrent_delta_rule`` (DeltaNet: β given, K×V state)."""

    family = "delta_rule"

    def canonical(self, kw):
        q, k = kw["q"], kw["k"]
        if kw.get("use_qk_l2norm_in_kernel", False):
            q, k = l2norm(q), l2norm(k)
        return Canonical(
            q=q.float(), k=k.float(), v=kw["v"].float(), beta=kw["beta"].float(),
            scale=_scale(kw, k.shape[-1]),
            initial_state=self._initial_state(kw), cu_seqlens=kw.get("cu_seqlens"),
        )


class GatedDeltaRuleAdapter(Adapter):
    """``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` (Gated DeltaNet)."""

    family = "gated_delta_rule"

    def gate(self, kw):
        g = kw["g"].float()
        if kw.get("use_gate_in_kernel", False):
            g = -kw["A_log"].float().exp() * F.softplus(g + kw["dt_bias"].float())
        return g

    def canonical(self, kw):
        v = kw["v"].float()
        hv = v.shape[2]
        q, k = kw["q"], kw["k"]
        if kw.get("use_qk_l2norm_in_kernel", False):
            q, k = l2norm(q), l2norm(k)
        return Canonical(
            q=_expand_heads(q.float(), hv), k=_expand_heads(k.float(), hv), v=v,
            beta=_beta(kw["beta"], kw), g=self.gate(kw), scale=_scale(kw, k.shape[-1]),
            initial_state=self._initial_state(kw), cu_seqlens=kw.get("cu_seqlens"),
        )


class KDAAdapter(GatedDeltaRuleAdapter):
    """``chunk_kda`` / ``fused_recurrent_kda``: a per-key-channel gate ``g: [B, T, HV, K]``."""

    family = "kda"

    def gate(self, kw):
        g = kw["g"].float()
        if not kw.get("use_gate_in_kernel", False):
            return g
        hv, K = g.shape[2], g.shape[3]
        dt_bias = kw.get("dt_bias")
        a = g if dt_bias is None else g + dt_bias.float().view(hv, K)
        A_log = kw.get("A_log")
        lower_bound = kw.get("lower_bound")
        if lower_bound is None:
            return -A_log.float().exp().view(hv, 1) * F.softplus(a)
        if A_log is not None:
            a = A_log.float().exp().view(hv, 1) * a
        return lower_bound * a.sigmoid()


class PrecondAdapter(Adapter):
    """fla's preconditioned delta rules (``precond_gated_delta_rule``, ``precond_kda``): they carry a
    d of their own, built inside the kernel from a decayed second-moment accumulator."""

    returns_extra_state = True

    def __init__(self, family: str, gate_adapter: Adapter | None = None):
        self.family = family
        self._gate_adapter = gate_adapter

    def canonical(self, kw):
        v = kw["v"].float()
        hv = v.shape[2]
        q, k = l2norm(kw["q"]), l2norm(kw["k"])  # always normalised inside these ops
        K = k.shape[-1]
        g = kw.get("g")
        if g is not None:
            g = self._gate_adapter.gate(kw) if self._gate_adapter else g.float()
        A_traj, A_final = precond_accumulator(
            k, kw["g_atk"].float(), kw["beta_atk"].float(), kw.get("initial_A_state"), kw.get("cu_seqlens")
        )
        h_atk = A_traj.shape[2]
        scale_atk = kw.get("log_atk_scale")
        scale_atk = (
            torch.full((h_atk,), -0.2, device=k.device) if scale_atk is None else scale_atk.float()
        )
        r = torch.log(A_traj + float(kw.get("eps", 1e-6))) - scale_atk.view(1, 1, h_atk, 1)
        d = torch.exp(-math.log(float(kw.get("x", 1.5))) * r / (1.0 + r.abs()))
        return Canonical(
            q=_expand_heads(q, hv), k=_expand_heads(k, hv), v=v,
            beta=kw["beta"].float(), g=g, d=_expand_heads(d, hv), scale=_scale(kw, K),
            initial_state=self._initial_state(kw), cu_seqlens=kw.get("cu_seqlens"),
            extra_final=A_final,
        )


class OSDNAdapter(Adapter):
    """``chunk_osdn`` (phase 2 of the OSDN / OSGDN layers): read key ``k``, write key ``k̃ = d ⊙ k``.

    The layer passes keys already activated and normalised, β already squashed and ``g`` as a log
    decay, so nothing is reproduced here except ``d``: capture hands the adapter the phase-1
    trajectory of the same layer call under :data:`PHASE1_D`. Without one (``chunk_osdn`` called on
    its own) ``d`` is recovered as ``k̃ / k`` where ``k ≠ 0`` (1 elsewhere) and the record is flagged
    ``d_source = "write_key/k"``.
    """

    family = "osdn"  # "osgdn" for a gated call, see record()

    def state_is_v_first(self, kw):
        return True  # chunk_osdn's state is [N, H, V, K]

    def record(self, kw, out, **where):
        call = super().record(kw, out, **where)
        call.family = "osgdn" if kw.get("g") is not None else "osdn"
        return call

    def canonical(self, kw):
        k = kw["k"].float()
        d = kw.get(PHASE1_D)
        if d is None:
            wk = kw["write_key"].float()
            d = torch.where(k != 0, wk / torch.where(k != 0, k, 1.0), torch.ones_like(k))
        g = kw.get("g")
        return Canonical(
            q=kw["q"].float(), k=k, v=kw["v"].float(), beta=kw["beta"].float(),
            g=None if g is None else g.float(), d=d.float(), scale=_scale(kw, k.shape[-1]),
            initial_state=self._initial_state(kw), cu_seqlens=kw.get("cu_seqlens"),
        )

    def flags(self, kw):
        return {"d_source": "phase1" if kw.get(PHASE1_D) is not None else "write_key/k"}

    def reference(self, kw):
        c = self.canonical(kw)
        res = delta_rule_recurrence(
            c.q, c.k, c.v, c.beta, write_key=kw["write_key"].float(), g=c.g, scale=c.scale,
            initial_state=c.initial_state, cu_seqlens=c.cu_seqlens, dtype=torch.float32,
        )
        final = res.final_state.contiguous() if kw.get("output_final_state", False) else None
        return res.o.to(kw["v"].dtype), final


#: The keyword under which capture passes a layer call's phase-1 ``d`` trajectory to :class:`OSDNAdapter`.
PHASE1_D = "_osdn_phase1_d"


def _phase1_reference(kw: dict):
    """Phase 1 by the reference sweep (fp32 for bf16/fp32 keys), from the arguments an OSDN kernel
    received (``osdn_precondition``'s and ``fused_recurrent_osdn``'s share their names)."""
    from ..math.phase1 import osdn_phase1

    return osdn_phase1(
        kw["k"], kw["beta"], retention=kw.get("retention"), d0=kw.get("d0"), eta=kw["eta"],
        d_min=kw["d_min"], d_max=kw["d_max"], beta_aware=kw["beta_aware"], eps=kw["eps"],
        cu_seqlens=kw.get("cu_seqlens"),
    )


class FusedOSDNAdapter(OSDNAdapter):
    """``fused_recurrent_osdn``: both OSDN phases in one kernel. Capture asks it for the ``d``
    trajectory (``return_trajectory``, see :attr:`trajectory`), so the record holds the exact ``d``
    the kernel wrote with, and hands the caller back only what it asked for."""

    trajectory = True

    def canonical(self, kw):
        return super().canonical({**kw, "write_key": None})

    def flags(self, kw):
        return {"d_source": "fused kernel"}

    def output(self, out):
        return out.o

    def reference(self, kw):
        """Phase 1 then phase 2 by the references (fp32), in the kernel's return format."""
        from ..ops.osdn_recurrent import FusedRecurrentResult

        k = kw["k"]
        p1 = _phase1_reference(kw)
        g = kw.get("g")
        h0 = kw.get("initial_state")
        res = delta_rule_recurrence(
            kw["q"].float(), k.float(), kw["v"].float(), kw["beta"].float(), write_key=p1.write_key,
            g=None if g is None else g.float(), scale=_scale(kw, k.shape[-1]),
            initial_state=None if h0 is None else h0.float(), cu_seqlens=kw.get("cu_seqlens"),
            dtype=torch.float32,
        )
        return FusedRecurrentResult(
            o=res.o.to(kw["v"].dtype),
            final_state=res.final_state.contiguous() if kw.get("output_final_state") else None,
            d_final=p1.d_final, d=p1.d if kw.get("return_trajectory") else None,
        )


class Phase1Site:
    """Marks ``osdn_precondition`` at an OSDN layer's call site: capture runs it with the trajectory
    on (returning what the caller asked for) and keeps ``d`` for the layer's phase-2 record."""

    family = "osdn_phase1"

    @staticmethod
    def reference(kw: dict):
        """Phase 1 by the reference sweep (fp32), in the kernel's return format (with trajectory)."""
        from ..math.phase1 import Phase1Result

        res = _phase1_reference(kw)
        return Phase1Result(write_key=res.write_key.to(kw["k"].dtype), d=res.d, d_final=res.d_final)


def precond_accumulator(k, g_atk, beta_atk, A0, cu_seqlens):
    """``A_t = exp(g_atk_t) A_{t−1} + β_atk_t k_t⊙k_t`` on the heads of ``g_atk`` (``[B, T, Ha]``), for
    normalised keys ``k: [B, T, H, K]``. Returns ``(A_t for every t [B, T, Ha, K], final [N, Ha, K])``."""
    B, T, _, K = k.shape
    ha = g_atk.shape[2]
    if k.shape[2] != ha:  # the accumulator lives on its own heads (key heads, or value heads)
        k = _expand_heads(k, ha) if ha > k.shape[2] else k
    s = k * k
    decay = g_atk.exp()[..., None]
    A_traj = torch.empty(B, T, ha, K, dtype=torch.float32, device=k.device)
    offsets = [0, T] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    rows = [(slice(None), 0, T, 0)] if cu_seqlens is None else [
        (slice(0, 1), s0, e0, n) for n, (s0, e0) in enumerate(zip(offsets[:-1], offsets[1:]))
    ]
    finals = []
    for row, start, end, n in rows:
        if A0 is None:
            A = torch.zeros(B if cu_seqlens is None else 1, ha, K, device=k.device)
        else:
            A = A0.float() if cu_seqlens is None else A0[n : n + 1].float()
        for t in range(start, end):
            A = decay[row, t] * A + beta_atk[row, t, :, None] * s[row, t]
            A_traj[row, t] = A
        finals.append(A)
    return A_traj, torch.cat(finals, dim=0)


@dataclass(frozen=True)
class KernelSite:
    """A kernel entry point as an fla layer module sees it: ``module.name``, and its adapter."""

    module: str
    name: str
    adapter: Adapter


_GDN = GatedDeltaRuleAdapter()
_KDA = KDAAdapter()

#: Every kernel entry point capture intercepts, by the layer module that calls it (fla 0.6.0).
ADAPTERS: tuple[KernelSite, ...] = (
    KernelSite("fla.layers.delta_net", "chunk_delta_rule", DeltaRuleAdapter()),
    KernelSite("fla.layers.delta_net", "fused_recurrent_delta_rule", DeltaRuleAdapter()),
    KernelSite("fla.layers.gated_deltanet", "chunk_gated_delta_rule", _GDN),
    KernelSite("fla.layers.gated_deltanet", "fused_recurrent_gated_delta_rule", _GDN),
    KernelSite("fla.layers.kda", "chunk_kda", _KDA),
    KernelSite("fla.layers.kda", "fused_recurrent_kda", _KDA),
    KernelSite("fla.layers.precond_gated_deltanet", "chunk_precond_gated_delta_rule",
               PrecondAdapter("precond_gated_delta_rule")),
    KernelSite("fla.layers.precond_gated_deltanet", "fused_recurrent_precond_gated_delta_rule",
               PrecondAdapter("precond_gated_delta_rule")),
    KernelSite("fla.layers.precond_gated_deltanet", "naive_recurrent_precond_gated_delta_rule",
               PrecondAdapter("precond_gated_delta_rule")),
    KernelSite("fla.layers.precond_kda", "chunk_precond_kda", PrecondAdapter("precond_kda", _KDA)),
    KernelSite("fla.layers.precond_kda", "fused_recurrent_precond_kda", PrecondAdapter("precond_kda", _KDA)),
    # The OSDN / OSGDN layers call their kernels through osdn_diag.layers._common.
    KernelSite("osdn_diag.layers._common", "osdn_precondition", Phase1Site()),
    KernelSite("osdn_diag.layers._common", "chunk_osdn", OSDNAdapter()),
    KernelSite("osdn_diag.layers._common", "fused_recurrent_osdn", FusedOSDNAdapter()),
)
