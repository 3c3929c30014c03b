"""What fla 0.6.0's delta-rule kernels consumed, observed from inside fla, and an fp64 replay of it.

The capture tests need ground truth that does not come from the package: the tensors fla's
recurrence actually read. Some of them are made by a separate, stored step before the recurrence
(``l2norm_fwd`` for q and k, ``fused_beta_sigmoid`` for β, ``chunk_atk_fwd`` for the preconditioned
write key); :func:`spy_consumed` records those by replacing the module-global names that fla's
forward functions look up (``fla.ops.gated_delta_rule.chunk.l2norm_fwd``, ...) with wrappers that call
the original and keep its output. It also records the raw arguments of every kernel call at the
layer's call site (``fla.layers.gated_deltanet.chunk_gated_delta_rule``, ...).

Enter :func:`spy_consumed` *before* ``capture(...)``: capture then wraps the spies (it looks up the
current attribute), so a spy sees the arguments exactly as the kernel receives them, including the
``output_final_state=True`` capture adds. Capture rebuilds its record after the kernel returns, and
may call ``l2norm_fwd`` / ``chunk_atk_fwd`` again for that; the internal spies keep only what is
produced while a call-site spy is inside the kernel, so those later calls are not mistaken for what
the kernel consumed.

Values a kernel computes in registers (the fused recurrent kernels' l2 norm, β sigmoid, gates and
the preconditioned layers' d) cannot be observed; :meth:`KernelRun.consumed` rebuilds them from
the raw arguments: the l2 norm in the kernel's own fp32 arithmetic, the rest in fp64. The gates
are rebuilt in fp64 on every path (the chunk kernels fuse them with a cumulative sum that is not
a per-token tensor).

:func:`fp64_delta_rule` is an independent fp64 replay of the consumed tensors, vectorised over
batch and heads (a Python loop over time), used as the oracle for the package's replay.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = [
    "CALL_SITES",
    "INTERNALS",
    "KernelRun",
    "RATIO_FLOOR",
    "assert_record_is_consumed",
    "compare_ratios",
    "fp64_delta_rule",
    "kernel_final_state",
    "oracle",
    "per_head_state_error",
    "register_l2norm",
    "relative_error",
    "spy_consumed",
    "stores_qk",
]

#: Kernel entry points as fla 0.6.0's layers look them up: (layer module, name, path).
CALL_SITES = (
    ("fla.layers.delta_net", "chunk_delta_rule", "chunk"),
    ("fla.layers.delta_net", "fused_recurrent_delta_rule", "fused_recurrent"),
    ("fla.layers.gated_deltanet", "chunk_gated_delta_rule", "chunk"),
    ("fla.layers.gated_deltanet", "fused_recurrent_gated_delta_rule", "fused_recurrent"),
    ("fla.layers.kda", "chunk_kda", "chunk"),
    ("fla.layers.kda", "fused_recurrent_kda", "fused_recurrent"),
    ("fla.layers.precond_gated_deltanet", "chunk_precond_gated_delta_rule", "chunk"),
    ("fla.layers.precond_gated_deltanet", "fused_recurrent_precond_gated_delta_rule", "fused_recurrent"),
    ("fla.layers.precond_kda", "chunk_precond_kda", "chunk"),
    ("fla.layers.precond_kda", "fused_recurrent_precond_kda", "fused_recurrent"),
)

#: The stored steps the recurrences read from, where fla's forward functions look them up.
INTERNALS = (
    ("fla.ops.delta_rule.chunk", "l2norm_fwd"),
    ("fla.ops.delta_rule.fused_recurrent", "l2norm_fwd"),
    ("fla.ops.gated_delta_rule.chunk", "l2norm_fwd"),
    ("fla.ops.gated_delta_rule.chunk", "fused_beta_sigmoid"),
    ("fla.ops.kda.chunk", "l2norm_fwd"),
    ("fla.ops.kda.chunk", "fused_beta_sigmoid"),
    ("fla.ops.precond_gated_delta_rule.chunk", "l2norm_fwd"),
    ("fla.ops.precond_gated_delta_rule.chunk", "chunk_atk_fwd"),
    ("fla.ops.precond_kda.chunk", "l2norm_fwd"),
    ("fla.ops.precond_kda.chunk", "chunk_atk_fwd"),
)

#: fla's l2-norm epsilon (inside the square root), in every kernel.
L2NORM_EPS = 1e-6


def register_l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(Σx² + 1e-6)`` in fp32, the fused recurrent kernels' in-register arithmetic."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _family(site_module: str) -> str:
    return site_module.rsplit(".", 1)[1]


@dataclass
class KernelRun:
    """One kernel call as fla ran it.

    Attributes:
        family: the layer module's name (``delta_net``, ``gated_deltanet``, ``kda``,
            ``precond_gated_deltanet``, ``precond_kda``).
        kernel: the entry point's name; ``path``: ``"chunk"`` or ``"fused_recurrent"``.
        args: the raw arguments by name (defaults filled in), as the kernel received them.
        stored: ``{internal name: [outputs]}`` of the stored steps run while the kernel executed:
            ``l2norm_fwd`` → ``[q̂, k̂]`` (the normalised tensor, in the input dtype),
            ``fused_beta_sigmoid`` → ``[β]``, ``chunk_atk_fwd`` → ``[k_precond]``.
        stored_inputs: the tensor each stored step was given (its first argument), same order.
        out: what the kernel returned (copied).
    """

    family: str
    kernel: str
    path: str
    args: dict
    stored: dict = field(default_factory=dict)
    stored_inputs: dict = field(default_factory=dict)
    out: object = None

    @property
    def qk_stored(self) -> bool:
        """Whether fla normalised q and k with the stored ``l2norm_fwd`` during this call."""
        return "l2norm_fwd" in self.stored

    @property
    def precond(self) -> bool:
        return self.family.startswith("precond")

    def consumed(self) -> dict:
        """What the recurrence read, in fp64, in the record's conventions (``[B, T, H, ·]``, state
        ``V×K``): ``q, k, v, beta`` and, where present, ``g`` (head gate ``[B, T, H]``), ``gk``
        (key-channel gate ``[B, T, H, K]``) and ``write_key``.

        Stored tensors come from the spies; register values are rebuilt from the raw arguments.
        Only what the tests build is supported: no initial state, no grouped value heads, no KDA
        ``lower_bound``.
        """
        a = self.args
        if a.get("initial_state") is not None or a.get("initial_A_state") is not None:
            raise NotImplementedError("the oracle starts from a zero state")
        H, HV = a["k"].shape[2], a["v"].shape[2]
        if H != HV:
            raise NotImplementedError("the oracle has no grouped value heads")
        if self.qk_stored:
            q, k = self.stored["l2norm_fwd"]
        elif a.get("use_qk_l2norm_in_kernel", False):
            q, k = register_l2norm(a["q"]), register_l2norm(a["k"])
        else:
            q, k = a["q"], a["k"]
        out = {"q": q.double(), "k": k.double(), "v": a["v"].double()}

        # β: GDN/KDA take raw logits (sigmoid, ×2 with negative eigenvalues) — stored by the chunk
        # paths, in registers on the fused ones; DeltaNet and the precond layers pass β squashed.
        if "fused_beta_sigmoid" in self.stored:
            (beta,) = self.stored["fused_beta_sigmoid"]
        elif a.get("use_beta_sigmoid_in_kernel", False):
            beta = a["beta"].double().sigmoid() * (2.0 if a.get("allow_neg_eigval", False) else 1.0)
        else:
            beta = a["beta"]
        out["beta"] = beta.double()

        # Gates in fp64 from the raw arguments.
        if self.family in ("gated_deltanet", "kda") and a.get("use_gate_in_kernel", False):
            if a.get("lower_bound") is not None:
                raise NotImplementedError("KDA's lower_bound gate")
            A = a["A_log"].double().exp()
            raw = a["g"].double()
            if self.family == "gated_deltanet":
                bias = 0.0 if a.get("dt_bias") is None else a["dt_bias"].double()
                out["g"] = -A * F.softplus(raw + bias)
            else:
                bias = 0.0 if a.get("dt_bias") is None else a["dt_bias"].double().view(HV, -1)
                out["gk"] = -A.view(HV, 1) * F.softplus(raw + bias)
        elif self.family in ("gated_deltanet", "precond_gated_deltanet"):
            out["g"] = a["g"].double()
        elif self.family in ("kda", "precond_kda"):
            out["gk"] = a["g"].double()

        if self.precond:
            if "chunk_atk_fwd" in self.stored:
                (wk,) = self.stored["chunk_atk_fwd"]
                out["write_key"] = wk.double()
            else:
                out["write_key"] = precond_d(out["k"], a) * out["k"]
        return out


def stores_qk(family: str, path: str) -> bool:
    """Where fla 0.6.0 stores the normalised q, k (``l2norm_fwd``, in the input dtype) before the
    recurrence reads them: every chunk path, and both DeltaNet paths."""
    return path == "chunk" or family == "delta_net"


def kernel_final_state(run: KernelRun) -> torch.Tensor:
    """The kernel's own final state from its return value, as ``[N, H, V, K]``."""
    S = run.out[1]
    v_first = bool(run.args.get("state_v_first") or run.args.get("transpose_state_layout"))
    return S if v_first else S.transpose(-1, -2)


def assert_record_is_consumed(run: KernelRun, call) -> None:
    """The capture record ``call`` holds what ``run``'s recurrence consumed, bit for bit where fla
    stored it: q̂, k̂ (``l2norm_fwd``), the preconditioned chunk paths' write key (``chunk_atk_fwd``),
    the GDN/KDA chunk paths' β (``fused_beta_sigmoid``) and the kernel's final state; where the
    kernel normalises in registers, its fp32 arithmetic on the raw arguments. ``flags["qk_read_as"]``
    names the dtype the recurrence read q and k in."""
    dtype = run.args["k"].dtype
    stored = stores_qk(run.family, run.path)
    # fla itself behaves as the call-site notes say (else the expectations below are moot).
    assert run.qk_stored == stored, (run.family, run.path, sorted(run.stored))
    assert call.input_dtype == str(dtype).removeprefix("torch.")

    if stored:
        q_hat, k_hat = run.stored["l2norm_fwd"]
        # The two normalisations were given the raw q, then the raw k.
        q_in, k_in = run.stored_inputs["l2norm_fwd"]
        assert torch.equal(q_in, run.args["q"]) and torch.equal(k_in, run.args["k"])
        assert q_hat.dtype == k_hat.dtype == dtype
        assert torch.equal(call.q, q_hat.float()), "record's q is not the stored q̂ the kernel read"
        assert torch.equal(call.k, k_hat.float()), "record's k is not the stored k̂ the kernel read"
    else:
        # Normalised in fp32 registers: nothing stored to compare with, so the kernel's arithmetic
        # on its raw arguments, to fp32 rounding — and, for 16-bit inputs, not a 16-bit tensor.
        for name in ("q", "k"):
            torch.testing.assert_close(getattr(call, name), register_l2norm(run.args[name]), rtol=0, atol=1e-6)
        if dtype != torch.float32:
            assert not torch.equal(call.k, call.k.to(dtype).float()), "record's k was rounded to the input dtype"

    if run.precond and run.path == "chunk":
        (k_precond,) = run.stored["chunk_atk_fwd"]
        assert k_precond.dtype == dtype
        assert call.write_key is not None, "no write key in the record of a preconditioned chunk call"
        assert torch.equal(call.write_key, k_precond.float()), "record's write key is not chunk_atk_fwd's"
    if run.family in ("gated_deltanet", "kda") and run.path == "chunk":
        (beta,) = run.stored["fused_beta_sigmoid"]
        assert torch.equal(call.beta, beta.float()), "record's β is not fused_beta_sigmoid's"

    # The record says which dtype the recurrence read q and k in.
    expected = str(dtype).removeprefix("torch.") if stored else "float32"
    assert call.flags.get("qk_read_as") == expected, (call.flags.get("qk_read_as"), expected)

    # Capture asked the kernel for its fp32 final state and kept exactly that.
    assert run.args["output_final_state"] is True
    assert call.final_state is not None
    assert torch.equal(call.final_state, kernel_final_state(run).float())


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖x − ref‖ / ‖ref‖`` over the whole tensor, in fp64."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm())


def per_head_state_error(S: torch.Tensor, S_kernel: torch.Tensor) -> float:
    """Largest ``‖S − S_kernel‖_F / ‖S_kernel‖_F`` over (sequence, head)."""
    S, S_kernel = S.double(), S_kernel.double()
    err = (S - S_kernel).square().sum((-2, -1)).sqrt() / S_kernel.square().sum((-2, -1)).sqrt()
    return float(err.max())


def precond_d(k: torch.Tensor, a: dict) -> torch.Tensor:
    """fla's preconditioner, fp64: ``A_t = exp(g_atk)·A_{t−1} + β_atk·k⊙k``, ``r = log(A_t + eps) −
    log_atk_scale``, ``d = x^(−r/(1+|r|))`` — the accumulator updated before token t's write."""
    B, T, H, K = k.shape
    decay = a["g_atk"].double().exp()
    beta_atk = a["beta_atk"].double()
    scale = a.get("log_atk_scale")
    scale = torch.full((H,), -0.2, dtype=torch.float64, device=k.device) if scale is None else scale.double()
    eps, x = float(a.get("eps", 1e-6)), float(a.get("x", 1.5))
    A = torch.zeros(B, H, K, dtype=torch.float64, device=k.device)
    traj = torch.empty_like(k)
    for t in range(T):
        A = decay[:, t, :, None] * A + beta_atk[:, t, :, None] * k[:, t] * k[:, t]
        traj[:, t] = A
    r = torch.log(traj + eps) - scale.view(1, 1, H, 1)
    return torch.exp(-math.log(x) * r / (1.0 + r.abs()))


def fp64_delta_rule(q, k, v, beta, g=None, gk=None, write_key=None) -> dict:
    """The delta rule in fp64 from a zero state, ``S`` as ``V×K``, vectorised over ``[B, H]``.

    Per token: ``S̄ = exp(g)·S`` (head gate) or ``S·diag(exp(gk))`` (key-channel gate);
    ``u = v − S̄ k``; ``S ← S̄ + β u (write_key)ᵀ`` (write key ``k`` unless given);
    ``loss_before = ½‖S_{t−1} k − v‖²`` against the state *before* the decay,
    ``loss_after = ½‖S_t k − v‖²``, ``ratio = after / before`` (1 where before == 0).

    Returns ``loss_before, loss_after, ratio: [B, T, H]``, ``o: [B, T, H, V]`` (read-out with
    ``q·K^{-1/2}``) and ``final_state: [B, H, V, K]``.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    wk = k if write_key is None else write_key
    S = torch.zeros(B, H, V, K, dtype=torch.float64, device=k.device)
    before = torch.empty(B, T, H, dtype=torch.float64, device=k.device)
    after = torch.empty_like(before)
    o = torch.empty(B, T, H, V, dtype=torch.float64, device=k.device)
    qs = q * K**-0.5
    for t in range(T):
        kt, vt = k[:, t], v[:, t]  # [B, H, K], [B, H, V]
        before[:, t] = 0.5 * (torch.einsum("bhvk,bhk->bhv", S, kt) - vt).square().sum(-1)
        if g is not None:
            S = S * g[:, t].exp()[..., None, None]
        if gk is not None:
            S = S * gk[:, t].exp()[..., None, :]
        u = vt - torch.einsum("bhvk,bhk->bhv", S, kt)
        S = S + beta[:, t, :, None, None] * u[..., :, None] * wk[:, t, :, None, :]
        after[:, t] = 0.5 * (torch.einsum("bhvk,bhk->bhv", S, kt) - vt).square().sum(-1)
        o[:, t] = torch.einsum("bhvk,bhk->bhv", S, qs[:, t])
    ratio = torch.where(before == 0, torch.ones_like(after), after / torch.where(before == 0, 1.0, before))
    return {"loss_before": before, "loss_after": after, "ratio": ratio, "o": o, "final_state": S}


def oracle(run: KernelRun) -> dict:
    """:func:`fp64_delta_rule` on what ``run``'s recurrence consumed."""
    c = run.consumed()
    return fp64_delta_rule(c["q"], c["k"], c["v"], c["beta"],
                           g=c.get("g"), gk=c.get("gk"), write_key=c.get("write_key"))


#: Below this residual ratio, relative ratio differences are taken against it instead (see
#: :func:`compare_ratios`).
RATIO_FLOOR = 1e-3


def compare_ratios(columns: dict, ref: dict) -> dict:
    """The package's per-token replay columns against the fp64 oracle's ``[B, T, H]`` grids.

    Over the tokens whose reference ``loss_before`` exceeds 1e-6 × its median (elsewhere the ratio
    is a quotient of rounding errors), returns

    * ``p99``: the 99th percentile of ``|ratio − ratio_ref| / max(ratio_ref, RATIO_FLOOR)``. A token
      whose write cancels its residual down to a ratio r has its ``loss_after`` computed, in an fp32
      replay, from a residual that is a difference of terms of the size of ``v``: its relative
      rounding is about ε₃₂/√r, 1e-5 by itself near r = 3e-5. Such tokens (a few per thousand in
      the preconditioned layers, whose write gain can reach 1) are held to an absolute
      ``1e-3 × tolerance`` instead of a relative one, so that the check measures the replay's
      inputs and arithmetic rather than the conditioning of single tokens;
    * ``p99_strict``: the same with no floor, ``n_below_floor``: how many tokens the floor applies
      to, ``n``: how many tokens were compared;
    * ``q_geo`` / ``q_geo_ref``: the geometric means of the ratios over all tokens (floor 1e-30).
    """
    seq, head, pos = (columns[n].long() for n in ("sequence", "head", "pos"))
    ref_ratio = ref["ratio"].cpu()[seq, pos, head]
    ref_before = ref["loss_before"].cpu()[seq, pos, head]
    ratio = columns["residual_ratio"].double()
    ok = ref_before > 1e-6 * ref_before.median()
    diff, r = (ratio - ref_ratio).abs()[ok], ref_ratio[ok].abs()
    p99 = lambda x: float(torch.quantile(x, 0.99)) if x.numel() else 0.0  # noqa: E731
    geo = lambda x: float(x.clamp_min(1e-30).log().mean().exp())  # noqa: E731
    return {
        "p99": p99(diff / r.clamp_min(RATIO_FLOOR)),
        "p99_strict": p99(diff / r.clamp_min(1e-300)),
        "n": int(ok.sum()),
        "n_below_floor": int((r < RATIO_FLOOR).sum()),
        "q_geo": geo(ratio),
        "q_geo_ref": geo(ref_ratio),
    }


def _bind(fn, args: tuple, kwargs: dict) -> dict:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    out = dict(bound.arguments)
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and name in out:
            out.update(out.pop(name))
    return out


def _keep(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


@contextlib.contextmanager
def spy_consumed():
    """Spy on fla's kernel call sites and stored steps; yields the list of :class:`KernelRun`, one per
    kernel call in call order, filled as the model runs. Everything is restored on exit."""
    runs: list[KernelRun] = []
    current: list[KernelRun] = []  # the run whose kernel is executing (kernel calls do not nest)
    patched: list[tuple[object, str, object]] = []

    def site_spy(family, path, original):
        @functools.wraps(original)
        def spy(*args, **kwargs):
            run = KernelRun(family=family, kernel=getattr(original, "__name__", "?"), path=path,
                            args={k: _keep(v) for k, v in _bind(original, args, kwargs).items()})
            current.append(run)
            try:
                out = original(*args, **kwargs)
            finally:
                current.pop()
            run.out = tuple(_keep(x) for x in out) if isinstance(out, tuple) else _keep(out)
            runs.append(run)
            return out

        return spy

    def internal_spy(name, original):
        @functools.wraps(original)
        def spy(*args, **kwargs):
            out = original(*args, **kwargs)
            if current:
                first = args[0] if args else next(iter(kwargs.values()))
                kept = out[0] if isinstance(out, tuple) else out
                current[-1].stored.setdefault(name, []).append(_keep(kept))
                current[-1].stored_inputs.setdefault(name, []).append(_keep(first))
            return out

        return spy

    try:
        for module_name, name in INTERNALS:
            module = importlib.import_module(module_name)
            original = getattr(module, name)  # AttributeError: fla moved a name the tests rely on
            patched.append((module, name, original))
            setattr(module, name, internal_spy(name, original))
        for module_name, name, path in CALL_SITES:
            module = importlib.import_module(module_name)
            original = getattr(module, name)
            patched.append((module, name, original))
            setattr(module, name, site_spy(_family(module_name), path, original))
        yield runs
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)
