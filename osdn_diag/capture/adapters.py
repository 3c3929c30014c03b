"""One adapter per fla kernel family: from the arguments a kernel received to a :class:`KernelCall`.

Each adapter reproduces what its kernel does before and inside the recurrence (fla 0.6.0), so that
the captured record holds the tensors the recurrence actually read — bit for bit where fla stored
them (:mod:`osdn_diag.capture.kernel_inputs`):

* ``use_qk_l2norm_in_kernel``: ``x / sqrt(Σx² + 1e-6)``. The chunk paths (and both DeltaNet paths)
  store the result in the input dtype with fla's ``l2norm_fwd`` before the recurrence reads it; the
  other fused recurrent kernels keep it in fp32 registers. ``flags["qk_read_as"]`` says which;
* ``scale``: ``K^{-1/2}`` unless given;
* gated delta rule (GDN layer): β = sigmoid(logit) (×2 with ``allow_neg_eigval``) when
  ``use_beta_sigmoid_in_kernel``; ``g = −exp(A_log)·softplus(a + dt_bias)`` when ``use_gate_in_kernel``;
* KDA: the same β, and the per-channel gate ``−exp(A_log)·softplus(a + dt_bias)`` or, with
  ``lower_bound``, ``lower_bound·sigmoid(exp(A_log)·(a + dt_bias))``;
* preconditioned delta rules (``precond_gated_delta_rule``, ``precond_kda``): the diagonal
  accumulator ``A_t = exp(g_atk)·A_{t−1} + β_atk·k̂⊙k̂`` (updated *before* the write, unlike OSDN),
  ``r = log(A_t + eps) − log_atk_scale``, ``d_t = x^{−r/(1+|r|)}``, write key ``d_t ⊙ k̂`` — which the
  chunk paths store in the input dtype (``chunk_atk_fwd``), so the record keeps that stored write key
  beside ``d``;
* state layouts: every record holds the state ``V×K``; grouped value heads (``HV > H``) are expanded
  so that value head ``i`` reads key head ``i // (HV/H)``.
* the package's own OSDN / OSGDN layers (:mod:`osdn_diag.layers`): phase 1
  (``osdn_precondition``) is intercepted too, so the record holds the exact ``d_t`` the phase-1
  kernel produced for every token (not ``k̃ / k``), and phase 2 (``chunk_osdn``) is recorded like any
  other delta-rule kernel, with the write key it read.

Capture asks every kernel for its fp32 final state (and hands the caller only what it asked for);
the record keeps it, so replay can compare its own final state with the kernel's.

Each adapter can also *compute* the kernel's outputs with the reference recurrence, in the kernel's
own output format, so capture can stand in for the Triton kernel on a machine without a GPU. Like
the kernel, the stand-in takes NaN/Inf inputs and returns what they propagate to (NaN outputs and
states from the first such token of a sequence and head on): replay flags and excludes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..math.recurrence import delta_rule_recurrence
from . import kernel_inputs as ki
from .record import KernelCall

__all__ = ["ADAPTERS", "Adapter", "KernelSite", "OSDNAdapter", "Phase1Site", "l2norm"]

L2NORM_EPS = ki.L2NORM_EPS

#: Where a kernel entry point's recurrence runs: the chunked kernels, or one fused recurrent kernel.
PATHS = ("chunk", "fused_recurrent", "naive")


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's l2 norm in fp32 (as the fused recurrent kernels compute it): ``x / sqrt(Σ x² + 1e-6)``."""
    return ki.l2norm_in_registers(x)


def _dtype_name(x: torch.Tensor) -> str:
    return str(x.dtype).removeprefix("torch.")


def _expand_heads(x: torch.Tensor | None, hv: int) -> torch.Tensor | None:
    """Repeat key heads so that value head ``i`` reads key head ``i // (HV / H)``."""
    if x is None or x.shape[2] == hv:
        return x
    return x.repeat_interleave(hv // x.shape[2], dim=2)


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
    write_key: torch.Tensor | None = None      # k̃ as the kernel read it, where it is not d ⊙ k in fp32
    initial_state: torch.Tensor | None = None  # [N, HV, V, K]
    cu_seqlens: torch.Tensor | None = None
    extra_final: torch.Tensor | None = None    # e.g. the precond A-state at the end, kernel layout
    qk_read_as: str = "float32"                # the dtype the recurrence read q and k in


class Adapter:
    """Base class: ``canonical(kwargs, fla=...)`` and the kernel's output format.

    Args:
        path: ``"chunk"``, ``"fused_recurrent"`` or ``"naive"`` — decides where fla rounds.
        stores_qk: whether this path stores the l2-normalised q and k (``l2norm_fwd``) before the
            recurrence reads them (default: the chunk path does, the others normalise in registers).
    """

    family: str = ""
    returns_extra_state = False

    def __init__(self, path: str = "chunk", *, stores_qk: bool | None = None):
        if path not in PATHS:
            raise ValueError(f"argument 'path': expected one of {PATHS}, got {path!r}")
        self.path = path
        self.stores_qk = (path == "chunk") if stores_qk is None else stores_qk

    def canonical(self, kw: dict, *, fla: bool) -> Canonical:  # pragma: no cover - abstract
        raise NotImplementedError

    def state_is_v_first(self, kw: dict) -> bool:
        return bool(kw.get("state_v_first", False) or kw.get("transpose_state_layout", False))

    def _initial_state(self, kw: dict) -> torch.Tensor | None:
        h0 = kw.get("initial_state")
        if h0 is None:
            return None
        h0 = h0.float()
        return h0 if self.state_is_v_first(kw) else h0.transpose(-1, -2)

    def _qk(self, kw: dict, *, fla: bool, always: bool = False) -> tuple[torch.Tensor, torch.Tensor, str]:
        """``(q, k, dtype read)`` as the recurrence reads them (fp32 tensors)."""
        q, k = kw["q"], kw["k"]
        if not (always or kw.get("use_qk_l2norm_in_kernel", False)):
            return q.float(), k.float(), _dtype_name(k)
        if self.path == "naive":  # fla's torch reference: F.normalize (eps outside the root), fp32
            return F.normalize(q.float(), dim=-1), F.normalize(k.float(), dim=-1), "float32"
        if self.stores_qk:
            return ki.l2norm_stored(q, fla=fla), ki.l2norm_stored(k, fla=fla), _dtype_name(k)
        return ki.l2norm_in_registers(q), ki.l2norm_in_registers(k), "float32"

    def _beta(self, kw: dict, *, fla: bool) -> torch.Tensor:
        beta = kw["beta"]
        if not kw.get("use_beta_sigmoid_in_kernel", False):
            return beta.float()
        scale = 2.0 if kw.get("allow_neg_eigval", False) else 1.0
        # The chunk path stores fused_beta_sigmoid's fp32 output; the fused kernels compute the same
        # in registers.
        return ki.beta_sigmoid(beta, scale, fla=fla and self.path == "chunk")

    def record(self, kw: dict, out, *, layer: int, layer_name: str, kernel: str, fla: bool = False) -> KernelCall:
        c = self.canonical(kw, fla=fla)
        o = self.output(out)
        final = self.final_state(out, kw)
        flags = self.flags(kw)
        flags["path"] = self.path
        flags["qk_read_as"] = c.qk_read_as
        return KernelCall(
            layer=layer,
            layer_name=layer_name,
            family=self.family,
            kernel=kernel,
            q=c.q, k=c.k, v=c.v, beta=c.beta, g=c.g, d=c.d, write_key=c.write_key,
            initial_state=c.initial_state,
            final_state=final,
            cu_seqlens=c.cu_seqlens,
            o=o.detach().float(),
            scale=c.scale,
            input_dtype=str(kw["q"].dtype).removeprefix("torch."),
            flags=flags,
        )

    def output(self, out) -> torch.Tensor:
        """The kernel's output tensor ``o`` from its return value."""
        return out[0] if isinstance(out, tuple) else out

    def final_state(self, out, kw: dict) -> torch.Tensor | None:
        """The kernel's fp32 final state from its return value, as ``[N, HV, V, K]`` (or ``None``)."""
        h = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if h is None:
            return None
        h = h.detach().float()
        return h if self.state_is_v_first(kw) else h.transpose(-1, -2)

    def strip_final_state(self, out):
        """The return value as a caller that did not ask for the final state gets it."""
        if isinstance(out, tuple):
            return (out[0], *(None for _ in out[1:]))
        return out

    def flags(self, kw: dict) -> dict:
        names = (
            "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
            "use_gate_in_kernel", "state_v_first", "transpose_state_layout", "lower_bound", "x", "eps",
        )
        return {n: kw[n] for n in names if n in kw and isinstance(kw[n], (bool, int, float))}

    def reference(self, kw: dict):
        """The kernel's return value, computed by the fp32 reference recurrence from what the kernel
        would read (fla's roundings emulated in torch)."""
        c = self.canonical(kw, fla=False)
        wk = c.write_key if c.write_key is not None else (None if c.d is None else c.d * c.k)
        res = delta_rule_recurrence(
            c.q, c.k, c.v, c.beta,
            write_key=wk,
            g=c.g, scale=c.scale, initial_state=c.initial_state, cu_seqlens=c.cu_seqlens,
            dtype=torch.float32, allow_nonfinite=True,
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
    """``chunk_delta_rule`` / ``fused_recurrent_delta_rule`` (DeltaNet: β given, K×V state). Both
    paths normalise q and k with ``l2norm_fwd`` (stored in the input dtype) before the recurrence."""

    family = "delta_rule"

    def __init__(self, path: str = "chunk"):
        super().__init__(path, stores_qk=True)

    def canonical(self, kw, *, fla):
        q, k, read_as = self._qk(kw, fla=fla)
        return Canonical(
            q=q, k=k, v=kw["v"].float(), beta=kw["beta"].float(),
            scale=_scale(kw, k.shape[-1]),
            initial_state=self._initial_state(kw), cu_seqlens=kw.get("cu_seqlens"), qk_read_as=read_as,
        )


class GatedDeltaRuleAdapter(Adapter):
    """``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` (Gated DeltaNet)."""

    family = "gated_delta_rule"

    def gate(self, kw, *, fla: bool = False):
        if not kw.get("use_gate_in_kernel", False):
            return kw["g"].float()
        return ki.gdn_gate(kw["g"], kw["A_log"], kw.get("dt_bias"), fla=fla)

    def canonical(self, kw, *, fla):
        v = kw["v"].float()
        hv = v.shape[2]
        q, k, read_as = self._qk(kw, fla=fla)
        return Canonical(
            q=_expand_heads(q, hv), k=_expand_heads(k, hv), v=v,
            beta=self._beta(kw, fla=fla), g=self.gate(kw, fla=fla), scale=_scale(kw, k.shape[-1]),
            initial_state=self._initial_state(kw), cu_seqlens=kw.get("cu_seqlens"), qk_read_as=read_as,
        )


class KDAAdapter(GatedDeltaRuleAdapter):
    """``chunk_kda`` / ``fused_recurrent_kda``: a per-key-channel gate ``g: [B, T, HV, K]``."""

    family = "kda"

    def gate(self, kw, *, fla: bool = False):
        if not kw.get("use_gate_in_kernel", False):
            return kw["g"].float()
        return ki.kda_gate(kw["g"], kw.get("A_log"), kw.get("dt_bias"), kw.get("lower_bound"), fla=fla)


class PrecondAdapter(Adapter):
    """fla's preconditioned delta rules (``precond_gated_delta_rule``, ``precond_kda``): they carry a
    d of their own, built inside the kernel from a decayed second-moment accumulator."""

    returns_extra_state = True

    def __init__(self, family: str, path: str = "chunk", gate_adapter: Adapter | None = None):
        super().__init__(path)
        self.family = family
        self._gate_adapter = gate_adapter

    def canonical(self, kw, *, fla):
        v = kw["v"].float()
        hv = v.shape[2]
        q, k, read_as = self._qk(kw, fla=fla, always=True)  # always normalised inside these ops
        K = k.shape[-1]
        g = kw.get("g")
        if g is not None:
            g = self._gate_adapter.gate(kw, fla=fla) if self._gate_adapter else g.float()
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
        write_key = None
        if self.stores_qk:
            # The chunk path stores k_precond = d ⊙ k̂ in the input dtype (chunk_atk_fwd) and writes
            # with that; the accumulator's heads are the keys' heads of the call.
            k_stored = k.to(kw["k"].dtype)
            write_key = _expand_heads(ki.precond_write_key_stored(k_stored, d, kw, fla=fla), hv)
        return Canonical(
            q=_expand_heads(q, hv), k=_expand_heads(k, hv), v=v,
            beta=kw["beta"].float(), g=g, d=_expand_heads(d, hv), write_key=write_key,
            scale=_scale(kw, K),
            initial_state=self._initial_state(kw), cu_seqlens=kw.get("cu_seqlens"),
            extra_final=A_final, qk_read_as=read_as,
        )

    def strip_final_state(self, out):
        return (out[0], None, None)


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

    def canonical(self, kw, *, fla=False):
        k = kw["k"].float()
        d = kw.get(PHASE1_D)
        wk = kw.get("write_key")
        if d is None:
            wkf = wk.float()
            d = torch.where(k != 0, wkf / torch.where(k != 0, k, 1.0), torch.ones_like(k))
        g = kw.get("g")
        return Canonical(
            q=kw["q"].float(), k=k, v=kw["v"].float(), beta=kw["beta"].float(),
            g=None if g is None else g.float(), d=d.float(),
            # The write key as phase 2 read it: phase 1 stores d ⊙ k in the keys' dtype.
            write_key=None if wk is None else wk.float(),
            scale=_scale(kw, k.shape[-1]),
            initial_state=self._initial_state(kw), cu_seqlens=kw.get("cu_seqlens"),
            qk_read_as=_dtype_name(kw["k"]),
        )

    def flags(self, kw):
        return {"d_source": "phase1" if kw.get(PHASE1_D) is not None else "write_key/k"}

    def reference(self, kw):
        c = self.canonical(kw)
        res = delta_rule_recurrence(
            c.q, c.k, c.v, c.beta, write_key=kw["write_key"].float(), g=c.g, scale=c.scale,
            initial_state=c.initial_state, cu_seqlens=c.cu_seqlens, dtype=torch.float32,
            allow_nonfinite=True,
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
        cu_seqlens=kw.get("cu_seqlens"), allow_nonfinite=True,
    )


class FusedOSDNAdapter(OSDNAdapter):
    """``fused_recurrent_osdn``: both OSDN phases in one kernel. Capture asks it for the ``d``
    trajectory (``return_trajectory``, see :attr:`trajectory`), so the record holds the exact ``d``
    the kernel wrote with, and hands the caller back only what it asked for."""

    trajectory = True

    def canonical(self, kw, *, fla=False):
        # Both phases run in one kernel: d and d ⊙ k never leave fp32 registers.
        return replace(super().canonical({**kw, "write_key": None}, fla=fla), qk_read_as="float32")

    def flags(self, kw):
        return {"d_source": "fused kernel"}

    def output(self, out):
        return out.o

    def final_state(self, out, kw):
        return None if out.final_state is None else out.final_state.detach().float()

    def strip_final_state(self, out):
        return replace(out, final_state=None)

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
            dtype=torch.float32, allow_nonfinite=True,
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


def _sites() -> tuple[KernelSite, ...]:
    from . import families  # its modules subclass Adapter: imported once this module has defined it

    gdn = {p: GatedDeltaRuleAdapter(p) for p in ("chunk", "fused_recurrent")}
    kda = {p: KDAAdapter(p) for p in ("chunk", "fused_recurrent")}
    pgdn, pkda = "precond_gated_delta_rule", "precond_kda"
    return (
        KernelSite("fla.layers.delta_net", "chunk_delta_rule", DeltaRuleAdapter("chunk")),
        KernelSite("fla.layers.delta_net", "fused_recurrent_delta_rule", DeltaRuleAdapter("fused_recurrent")),
        KernelSite("fla.layers.gated_deltanet", "chunk_gated_delta_rule", gdn["chunk"]),
        KernelSite("fla.layers.gated_deltanet", "fused_recurrent_gated_delta_rule", gdn["fused_recurrent"]),
        KernelSite("fla.layers.kda", "chunk_kda", kda["chunk"]),
        KernelSite("fla.layers.kda", "fused_recurrent_kda", kda["fused_recurrent"]),
        KernelSite("fla.layers.precond_gated_deltanet", "chunk_precond_gated_delta_rule",
                   PrecondAdapter(pgdn, "chunk")),
        KernelSite("fla.layers.precond_gated_deltanet", "fused_recurrent_precond_gated_delta_rule",
                   PrecondAdapter(pgdn, "fused_recurrent")),
        KernelSite("fla.layers.precond_gated_deltanet", "naive_recurrent_precond_gated_delta_rule",
                   PrecondAdapter(pgdn, "naive")),
        KernelSite("fla.layers.precond_kda", "chunk_precond_kda", PrecondAdapter(pkda, "chunk", kda["chunk"])),
        KernelSite("fla.layers.precond_kda", "fused_recurrent_precond_kda",
                   PrecondAdapter(pkda, "fused_recurrent", kda["fused_recurrent"])),
        # The OSDN / OSGDN layers call their kernels through osdn_diag.layers._common.
        KernelSite("osdn_diag.layers._common", "osdn_precondition", Phase1Site()),
        KernelSite("osdn_diag.layers._common", "chunk_osdn", OSDNAdapter("chunk")),
        KernelSite("osdn_diag.layers._common", "fused_recurrent_osdn", FusedOSDNAdapter("fused_recurrent")),
        # fla's further families (GatedDeltaProduct, Comba, GDN2, ...): osdn_diag.capture.families.
        *families.sites(),
    )


#: Every kernel entry point capture intercepts, by the layer module that calls it (fla 0.6.0).
ADAPTERS: tuple[KernelSite, ...] = _sites()
