"""Capture for transformers' own delta-rule models: Qwen3-Next, Qwen3.5 (dense and MoE), Kimi Linear
and OLMo-Hybrid (transformers 5).

These models are not fla models: their linear-attention layers live in
``transformers/models/<name>/modeling_<name>.py`` and call a module-level function of that file
(``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``, ...). At import, transformers'
``use_kernel_func_from_hub_with_fallback(<fla name>, "fla")`` binds that name to a wrapper that runs
fla's kernel (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, ...) when fla imports, and the
file's own torch implementation otherwise (a Hub kernel, if ``kernels`` is installed and asked for,
replaces either). Capture therefore intercepts the name *in the modeling file*, whatever it is bound
to, and asks :func:`resolve` which implementation runs:

* ``"fla"`` (or another implementation with fla's signature, e.g. a Hub build of fla): the call is
  described by the fla adapters of :mod:`osdn_diag.capture.adapters`, from the arguments as
  transformers hands them to the implementation;
* ``"torch"``: the modeling file's fallback, described by :class:`TorchFallbackAdapter`, which
  reproduces what that function does before its recurrence (grouped value heads expanded, fp32
  casts, its own l2 norm) — the fallback computes in fp32 throughout.

What each model passes (all: q, k, v activated by the short convolution and not normalised,
``use_qk_l2norm_in_kernel=True``, β already squashed in the model's dtype, the log decay ``g``
computed in fp32 in the layer, the state ``[B, HV, K, V]``) is tabulated in
docs/transformers-models.md.

The model numbers its decoder layers (``layer_idx``); the record uses that number, and the
full-attention layers between them are listed by :func:`skipped_layers`. A padded batch reaches the
kernel padded (these layers zero the padded tokens' hidden states but do not unpad), so
:func:`pack_padded` keeps only the real tokens of each row, as packed sequences.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from . import kernel_inputs as ki
from .adapters import Adapter, Canonical, GatedDeltaRuleAdapter, KDAAdapter, _expand_heads
from .record import KernelCall

__all__ = [
    "MODELS",
    "Bound",
    "HFKernelSite",
    "HFModel",
    "TorchFallbackAdapter",
    "layer_classes",
    "loaded_sites",
    "pack_padded",
    "resolve",
    "skipped_layers",
    "to_fla_names",
]


@dataclass(frozen=True)
class HFModel:
    """A transformers model whose linear-attention layers capture knows.

    Attributes:
        model_type: the config's ``model_type``.
        module: the modeling module (``transformers.models.<name>.modeling_<name>``).
        layer_class: the linear-attention layer class in it.
        family: ``"gated_delta_rule"`` (a head gate) or ``"kda"`` (a key-channel gate).
        chunk, recurrent: the module-level names the layer calls for a prompt and for a cached
            one-token step.
        l2norm: the fallback's l2 norm, ``"rsqrt"`` (``x · rsqrt(Σx² + 1e-6)``, Qwen, OLMo) or
            ``"sqrt"`` (``x / sqrt(Σx² + 1e-6)``, fla's form, Kimi).
    """

    model_type: str
    module: str
    layer_class: str
    family: str
    chunk: str
    recurrent: str
    l2norm: str


_GDN = dict(family="gated_delta_rule", chunk="torch_chunk_gated_delta_rule",
            recurrent="torch_recurrent_gated_delta_rule", l2norm="rsqrt")
#: The transformers models capture knows (transformers 5.24).
MODELS: tuple[HFModel, ...] = (
    HFModel("qwen3_next", "transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet", **_GDN),
    HFModel("qwen3_5", "transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet", **_GDN),
    HFModel("qwen3_5_moe", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet",
            **_GDN),
    HFModel("olmo_hybrid", "transformers.models.olmo_hybrid.modeling_olmo_hybrid", "OlmoHybridGatedDeltaNet",
            **_GDN),
    HFModel("kimi_linear", "transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinearDeltaAttention",
            family="kda", chunk="chunk_kimi_delta_attention", recurrent="recurrent_kimi_delta_attention",
            l2norm="sqrt"),
)

#: The fla entry point transformers binds to each modeling-file name.
FLA_NAMES = {
    "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
    "chunk_kimi_delta_attention": "chunk_kda",
    "recurrent_kimi_delta_attention": "fused_recurrent_kda",
}


#: How a fallback brings q and k to fp32 before its l2 norm (the norm's fp32 sums depend on the
#: memory layout they run over, so the record repeats the fallback's own steps):
#: ``"transpose-to"`` — ``x.transpose(1, 2).to(float32, memory_format=contiguous_format)`` (the Qwen /
#: OLMo functions), ``"transpose-contiguous"`` — ``x.transpose(1, 2).contiguous().to(float32)`` (Kimi's
#: chunked one), ``"as-is"`` — ``x.to(float32)`` in ``[B, T, H, K]`` (Kimi's token-by-token one).
FALLBACK_LAYOUTS = ("transpose-to", "transpose-contiguous", "as-is")


class TorchFallbackAdapter(Adapter):
    """A modeling file's torch implementation (``torch_chunk_gated_delta_rule``, ...), from its
    arguments renamed to fla's (:func:`to_fla_names`).

    It reproduces what the fallback does before its recurrence: grouped value heads expanded
    (``repeat_interleave``: value head ``i`` reads key head ``i // (HV / H)``), q, k, v, β and g cast to
    fp32 and — with ``use_qk_l2norm_in_kernel`` — q and k normalised by the fallback's own l2 norm,
    in its own layout and arithmetic, so that the record holds the fallback's q̂ and k̂ bit for bit;
    ``scale = K^{-1/2}``. Everything the recurrence reads is fp32 (``qk_read_as = "float32"``); the
    state is ``[B, HV, K, V]`` like fla's default. The fallbacks take no ``cu_seqlens`` (transformers
    refuses packed sequences without fla).

    Args:
        family: ``"gated_delta_rule"`` or ``"kda"``.
        path: ``"chunk"`` or ``"fused_recurrent"`` (the chunked or the token-by-token function).
        l2norm: ``"rsqrt"`` or ``"sqrt"`` (see :class:`HFModel`).
        layout: one of :data:`FALLBACK_LAYOUTS`.
    """

    def __init__(self, family: str, path: str, l2norm: str, layout: str):
        super().__init__(path, stores_qk=False)
        if l2norm not in ("rsqrt", "sqrt"):
            raise ValueError(f"argument 'l2norm': expected 'rsqrt' or 'sqrt', got {l2norm!r}")
        if layout not in FALLBACK_LAYOUTS:
            raise ValueError(f"argument 'layout': expected one of {FALLBACK_LAYOUTS}, got {layout!r}")
        self.family = family
        self.l2norm_form = l2norm
        self.layout = layout

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        """The fallback's l2 norm of an fp32 tensor, in its own arithmetic."""
        sq = (x * x).sum(dim=-1, keepdim=True) + ki.L2NORM_EPS
        return x * torch.rsqrt(sq) if self.l2norm_form == "rsqrt" else x / torch.sqrt(sq)

    def _read(self, x: torch.Tensor, hv: int, normalise: bool) -> torch.Tensor:
        x = _expand_heads(x, hv)
        if self.layout == "as-is":
            x = x.to(torch.float32)
            return self._normalise(x) if normalise else x
        if self.layout == "transpose-to":
            x = x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        else:
            x = x.transpose(1, 2).contiguous().to(torch.float32)
        return (self._normalise(x) if normalise else x).transpose(1, 2)

    def canonical(self, kw, *, fla=False):
        v = kw["v"]
        hv = v.shape[2]
        normalise = bool(kw.get("use_qk_l2norm_in_kernel", False))
        q, k = self._read(kw["q"], hv, normalise), self._read(kw["k"], hv, normalise)
        return Canonical(
            q=q, k=k, v=v.float(), beta=kw["beta"].float(), g=kw["g"].float(),
            scale=float(k.shape[-1] ** -0.5),
            initial_state=self._initial_state(kw), cu_seqlens=None, qk_read_as="float32",
        )

    def reference(self, kw):  # pragma: no cover - the fallback is torch: it always runs itself
        raise NotImplementedError("the torch fallback runs as it is; it needs no stand-in")


@dataclass(frozen=True)
class HFKernelSite:
    """One kernel name in one modeling file: the adapter for an fla-signature implementation and
    the one for the file's torch fallback."""

    model: HFModel
    name: str
    fla_name: str
    adapter: Adapter
    fallback: TorchFallbackAdapter

    @property
    def module(self) -> str:
        return self.model.module


def _sites(model: HFModel) -> tuple[HFKernelSite, ...]:
    fla_cls = KDAAdapter if model.family == "kda" else GatedDeltaRuleAdapter
    out = []
    for name, path in ((model.chunk, "chunk"), (model.recurrent, "fused_recurrent")):
        if model.family != "kda":
            layout = "transpose-to"
        else:
            layout = "transpose-contiguous" if path == "chunk" else "as-is"
        out.append(HFKernelSite(model, name, FLA_NAMES[name], fla_cls(path),
                                TorchFallbackAdapter(model.family, path, model.l2norm, layout)))
    return tuple(out)


SITES: tuple[HFKernelSite, ...] = tuple(site for model in MODELS for site in _sites(model))


def loaded_sites() -> tuple[HFKernelSite, ...]:
    """The sites whose modeling module is imported (a model of that type exists only then); capture
    never imports a modeling module itself."""
    return tuple(site for site in SITES if site.module in sys.modules)


def layer_classes() -> tuple[type, ...]:
    """The linear-attention layer classes of the imported modeling modules."""
    classes = []
    for model in MODELS:
        module = sys.modules.get(model.module)
        cls = getattr(module, model.layer_class, None) if module is not None else None
        if cls is not None:
            classes.append(cls)
    return tuple(classes)


def is_transformers_layer(module: torch.nn.Module) -> bool:
    return any(type(module).__name__ == m.layer_class and type(module).__module__ == m.module for m in MODELS)


@dataclass(frozen=True)
class Bound:
    """What a modeling file's kernel name runs.

    Attributes:
        kind: ``"fla"`` (fla's function), ``"torch"`` (the file's fallback) or ``"other"`` (something
            else with fla's signature, e.g. a Hub kernel).
        fn: that function.
        name: its dotted name, for the record.
    """

    kind: str
    fn: object
    name: str


def _dotted(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', getattr(fn, '__name__', repr(fn)))}"


def _closure(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return out


def kernel_function(bound):
    """The function behind a modeling file's kernel name: ``bound`` itself, or, where the ``kernels``
    package wraps it in a module (transformers 5.25 and later, which require that package), the
    function the module's ``forward`` calls (a closure variable ``func``). A module whose forward
    was replaced by a Hub kernel (``kernelize``) is returned as it is."""
    if isinstance(bound, torch.nn.Module) and "forward" not in vars(bound):
        func = _closure(type(bound).forward).get("func")
        if func is not None:
            return func
    return bound


def resolve(site: HFKernelSite, bound, device_type: str | None = None) -> Bound:
    """Which implementation ``bound`` (the object the modeling file's name is bound to) runs on
    inputs on ``device_type`` (``"cuda"``, ``"cpu"``; ``None``: not known).

    transformers 5's ``use_kernel_func_from_hub_with_fallback`` wrapper keeps the chosen
    implementation and the file's torch function in its closure (``implementation``,
    ``torch_function``); from transformers 5.25 it also keeps the devices the implementation's
    package runs on (``supported_devices``) and runs the torch function on any other (fla's on a
    CPU). A name bound to a plain function (fla's, the file's own) is that function.
    """
    fn = kernel_function(bound)
    cells = _closure(fn)
    impl, torch_fn = cells.get("implementation"), cells.get("torch_function")
    if impl is not None and torch_fn is not None:
        supported = cells.get("supported_devices")
        elsewhere = supported is not None and device_type is not None and device_type not in supported
        if impl is torch_fn or elsewhere:
            return Bound("torch", torch_fn, _dotted(torch_fn))
        fn = impl
    module = getattr(fn, "__module__", "") or ""
    if module == site.module and getattr(fn, "__name__", "") == site.name:
        return Bound("torch", fn, _dotted(fn))
    kind = "fla" if module == "fla" or module.startswith("fla.") else "other"
    return Bound(kind, fn, _dotted(fn))


def to_fla_names(kw: dict) -> dict:
    """A fallback's arguments (``query, key, value``) under fla's names (``q, k, v``)."""
    rename = {"query": "q", "key": "k", "value": "v"}
    return {rename.get(name, name): x for name, x in kw.items()}


def skipped_layers(model: torch.nn.Module, captured: list[int]) -> list[dict]:
    """The decoder layers of a transformers model that capture does not record (full attention),
    as ``[{"layer": i, "type": layer_types[i]}]``; empty for a model without ``layer_types``."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None) or []
    taken = set(captured)
    return [{"layer": i, "type": str(t)} for i, t in enumerate(types) if i not in taken]


def pack_padded(call: KernelCall, mask: torch.Tensor | None) -> KernelCall:
    """``call`` with only the real tokens of each row of a padded batch, packed (``B = 1`` with
    ``cu_seqlens``, sequences in row order).

    These layers multiply padded tokens' hidden states by 0 and run the kernel on the whole padded
    batch. With right padding the real tokens come first, so their recurrence is untouched by the
    padding after them; with left padding the padded tokens reach the kernel as exact zeros (no
    bias in the projections or the short convolution), so they leave a zero state unchanged. Either
    way the kernel's outputs at the real tokens are those of the unpadded sequences, and the
    record keeps them. The kernel's final state is kept only where it is the state after each
    row's last real token (every row ends at the last position and there is no initial state).

    Args:
        call: the record of one kernel call on ``[B, T]`` tokens (no ``cu_seqlens``).
        mask: the layer's 2-D ``attention_mask`` ``[B, T]`` (1 = a real token), or ``None``.

    Raises:
        ValueError: a row whose real tokens are not one contiguous block.
    """
    if mask is None or mask.dim() != 2 or call.cu_seqlens is not None:
        return call
    keep = mask.to(device=call.k.device).bool()
    if tuple(keep.shape) != tuple(call.k.shape[:2]):
        raise ValueError(f"attention_mask of shape {tuple(mask.shape)} does not match the kernel's "
                         f"[batch, tokens] = {tuple(call.k.shape[:2])}")
    if bool(keep.all()):
        return call
    T = keep.shape[1]
    spans = []
    for row in range(keep.shape[0]):
        idx = torch.nonzero(keep[row]).flatten().tolist()
        if idx and idx[-1] - idx[0] + 1 != len(idx):
            raise ValueError(f"attention_mask row {row} has padding between real tokens; capture "
                             "handles left or right padding only")
        spans.append((idx[0], len(idx)) if idx else (0, 0))

    def pack(x):
        if x is None:
            return None
        return torch.cat([x[row : row + 1, s : s + n] for row, (s, n) in enumerate(spans)], dim=1)

    lengths = torch.tensor([0] + [n for _, n in spans], dtype=torch.long)
    cu = torch.cumsum(lengths, 0).to(call.k.device)
    ends_at_last = all(n == 0 or s + n == T for s, n in spans)
    final = call.final_state if ends_at_last and call.initial_state is None else None
    packed = replace(
        call, q=pack(call.q), k=pack(call.k), v=pack(call.v), beta=pack(call.beta), g=pack(call.g),
        d=pack(call.d), write_key=pack(call.write_key), o=pack(call.o), final_state=final, cu_seqlens=cu,
        flags={**call.flags, "unpadded": True},
        # A family's per-token extras are packed like the other inputs; its per-sequence states
        # (initial_* / final_*) follow initial_state and final_state.
        extra={n: pack(x) if not n.startswith(("initial_", "final_")) else x
               for n, x in call.extra.items() if not n.startswith("final_") or final is not None},
    )
    return packed
