"""Ground truth for the transformers-model capture tests, written without the package's code.

* :func:`spy_kernel_calls` records the raw arguments every linear-attention layer of a transformers
  modeling file passes to its kernel name (``torch_chunk_gated_delta_rule``, ...), by replacing that
  name in the modeling module — entered *inside* ``capture(...)``, so it wraps capture's wrapper
  and sees the arguments as the layer wrote them.
* :func:`spy_fallback_qk` keeps what a modeling file's torch fallback normalised q and k to.
* :func:`spy_stored_qk` keeps what fla's chunk kernels store as their normalised q and k
  (``l2norm_fwd`` as ``fla.ops.gated_delta_rule.chunk`` / ``fla.ops.kda.chunk`` look it up) while
  a kernel runs: the tensors the recurrence read, bit for bit.
* :func:`consumed` gives what the recurrence consumed, as fp64 tensors: q and k as a chunk kernel
  stored them, or normalised from the raw arguments in the fp32 arithmetic of the implementation
  that ran; value head ``i`` reads key head ``i // (HV / H)``; β and the log decay as the layer
  computed them.
* :func:`fp64_delta_rule` replays those tensors in fp64: the state ``S ∈ R^{V×K}`` per head, the
  decay applied first (``exp(g)`` for a head gate, ``exp(g_k)`` on key channel ``k`` for KDA's
  gate), then ``S ← S + β (v − S k) kᵀ``, ``o = S (K^{-1/2} q)``; per token the regression losses
  ``½‖S k − v‖²`` before the write (pre-decay state) and after it.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import sys
from dataclasses import dataclass, field

import torch

EPS = 1e-6


@dataclass
class RawCall:
    """One kernel call as the layer made it: ``name`` (the modeling file's), ``args`` by the name the
    modeling file's torch function gives them (``query, key, value, g, beta, initial_state, ...``),
    each tensor copied before the call, and ``out`` (copied) afterwards."""

    name: str
    args: dict
    out: tuple | None = None


@contextlib.contextmanager
def spy_kernel_calls(module_name: str, names: tuple[str, ...]):
    """Record every call of ``module_name``'s ``names`` (a list of :class:`RawCall`, in call order)."""
    from osdn_diag.capture.transformers_sites import kernel_function

    module = sys.modules[module_name]
    calls: list[RawCall] = []
    saved = {name: getattr(module, name) for name in names}

    def spy(name, original):
        # the torch function's, through functools.wraps (under the `kernels` package's module, if any)
        sig = inspect.signature(kernel_function(original))

        def call(*args, **kwargs):
            bound = sig.bind_partial(*args, **kwargs)
            bound.apply_defaults()
            raw = {}
            for key, value in bound.arguments.items():
                if sig.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
                    raw.update(value)
                else:
                    raw[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
            rec = RawCall(name, raw)
            calls.append(rec)
            out = original(*args, **kwargs)
            rec.out = tuple(x.detach().clone() if isinstance(x, torch.Tensor) else x for x in out)
            return out

        return call

    for name, original in saved.items():
        setattr(module, name, spy(name, original))
    try:
        yield calls
    finally:
        for name, original in saved.items():
            setattr(module, name, original)


@contextlib.contextmanager
def spy_stored_qk():
    """``stored``: a list with, per chunk-kernel call, the pair ``(q̂, k̂)`` fla's ``l2norm_fwd`` stored."""
    stored: list[list[torch.Tensor]] = []
    modules = [importlib.import_module(m) for m in ("fla.ops.gated_delta_rule.chunk", "fla.ops.kda.chunk")]
    saved = [(m, m.l2norm_fwd) for m in modules]

    def spy(original):
        def l2norm_fwd(x, *args, **kwargs):
            out = original(x, *args, **kwargs)
            if not stored or len(stored[-1]) == 2:
                stored.append([])
            stored[-1].append(out[0].detach().clone())
            return out

        return l2norm_fwd

    for m, original in saved:
        m.l2norm_fwd = spy(original)
    try:
        yield stored
    finally:
        for m, original in saved:
            m.l2norm_fwd = original


@contextlib.contextmanager
def spy_fallback_qk(module_name: str):
    """``stored``: per torch-fallback call, ``(q̂, k̂)`` as the fallback's ``l2norm`` returned them
    (the module-level function of the modeling file both fallbacks call, q first), in the layout
    the fallback normalised in (``[B, HV, T, K]`` or ``[B, T, H, K]``; :func:`consumed` sorts it out)."""
    module = sys.modules[module_name]
    original = module.l2norm
    stored: list[list[torch.Tensor]] = []

    def l2norm(x, *args, **kwargs):
        out = original(x, *args, **kwargs)
        if not stored or len(stored[-1]) == 2:
            stored.append([])
        stored[-1].append(out.detach().clone())
        return out

    module.l2norm = l2norm
    try:
        yield stored
    finally:
        module.l2norm = original


def _expand(x: torch.Tensor, hv: int) -> torch.Tensor:
    """``[B, T, H, K]`` → ``[B, T, HV, K]``: value head ``i`` takes key head ``i // (HV / H)``."""
    h = x.shape[2]
    index = torch.arange(hv, device=x.device) // (hv // h)
    return x[:, :, index]


def normalise_fp32(x: torch.Tensor, form: str = "sqrt") -> torch.Tensor:
    """The l2 norm as an fp32 implementation computes it: ``x / sqrt(Σx² + 1e-6)`` (fla's kernels,
    Kimi's fallback) or ``x · rsqrt(Σx² + 1e-6)`` (the Qwen / OLMo fallbacks)."""
    x = x.float()
    sq = (x * x).sum(-1, keepdim=True) + EPS
    return x / torch.sqrt(sq) if form == "sqrt" else x * torch.rsqrt(sq)


def consumed(raw: RawCall, *, stored_qk: tuple | None = None, form: str = "sqrt") -> dict:
    """What the recurrence read, as fp64 tensors ``[B, T, HV, ·]``; state ``V×K`` (or None).

    q and k: ``stored_qk`` (what a chunk kernel stored, on the key heads) where given, else the raw
    q and k normalised in fp32 by ``form`` (:func:`normalise_fp32`) — the recurrence reads fp32
    values in both cases, and its result depends on their rounding; then value head ``i`` takes key
    head ``i // (HV / H)``. v, β, g as the layer passed them."""
    a = raw.args
    v = a["value"].double()
    hv = v.shape[2]
    if stored_qk is not None:
        T = v.shape[1]
        # [B, HV, T, K] (a fallback that normalised head-first; T differs from the head counts
        # in the tests) back to [B, T, HV, K]
        q, k = (x.transpose(1, 2) if x.shape[1] != T else x for x in stored_qk)
    elif a.get("use_qk_l2norm_in_kernel"):
        q, k = normalise_fp32(a["query"], form), normalise_fp32(a["key"], form)
    else:
        q, k = a["query"], a["key"]
    q, k = _expand(q.double(), hv), _expand(k.double(), hv)
    h0 = a.get("initial_state")
    return {
        "q": q, "k": k, "v": v, "beta": a["beta"].double(), "g": a["g"].double(),
        "scale": k.shape[-1] ** -0.5,
        "initial_state": None if h0 is None else h0.double().transpose(-1, -2),
    }


@dataclass
class Fp64Replay:
    o: torch.Tensor            # [B, T, H, V]
    final_state: torch.Tensor  # [B, H, V, K]
    loss_before: torch.Tensor  # [B, T, H], against the state before the token (pre-decay)
    loss_after: torch.Tensor   # [B, T, H]
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> torch.Tensor:
        """``loss_after / loss_before``, 1 where ``loss_before == 0``."""
        before = self.loss_before
        return torch.where(before > 0, self.loss_after / torch.where(before > 0, before, 1.0),
                           torch.ones_like(before))


def fp64_delta_rule(q, k, v, beta, g, scale, initial_state=None) -> Fp64Replay:
    """The gated delta rule in fp64 on ``[B, T, H, ·]`` tensors (one sequence per row); ``g`` is
    ``[B, T, H]`` (head gate) or ``[B, T, H, K]`` (key-channel gate)."""
    q, k, v, beta, g = (x.double() for x in (q, k, v, beta, g))
    B, T, H, K = k.shape
    V = v.shape[-1]
    S = torch.zeros(B, H, V, K, dtype=torch.float64, device=k.device)
    if initial_state is not None:
        S = S + initial_state.double()
    o = torch.empty(B, T, H, V, dtype=torch.float64, device=k.device)
    before = torch.empty(B, T, H, dtype=torch.float64, device=k.device)
    after = torch.empty_like(before)

    def loss(state, t):
        r = torch.einsum("bhvk,bhk->bhv", state, k[:, t]) - v[:, t]
        return 0.5 * (r * r).sum(-1)

    for t in range(T):
        before[:, t] = loss(S, t)
        decay = g[:, t].exp()
        S = S * (decay[..., None, None] if g.dim() == 3 else decay[:, :, None, :])
        u = v[:, t] - torch.einsum("bhvk,bhk->bhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * u[..., None] * k[:, t, :, None, :]
        after[:, t] = loss(S, t)
        o[:, t] = torch.einsum("bhvk,bhk->bhv", S, q[:, t] * scale)
    return Fp64Replay(o=o, final_state=S, loss_before=before, loss_after=after)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in fp64 (NaN anywhere gives NaN, which no tolerance passes)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def ratio_error(package: torch.Tensor, oracle: torch.Tensor) -> float:
    """Largest ``|q_pkg − q_oracle| / max(q_oracle, 1e-3)`` over tokens.

    A ratio is a quotient of two squared residuals; where the write almost cancels the residual
    (``q`` near 0) the fp32 numerator loses its relative accuracy while its absolute error stays at
    fp32 level, so errors are measured relative to ``max(q, 1e-3)``: 1e-5 of that is what an fp32
    replay of the same tensors can promise."""
    p, o = package.double(), oracle.double()
    err = (p - o).abs() / o.abs().clamp_min(1e-3)
    return float(err.max()) if not torch.isnan(err).any() else math.nan
