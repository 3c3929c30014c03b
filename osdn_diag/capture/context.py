"""``capture(model)``: record what every delta-rule kernel of an fla model receives.

    with osdn_diag.capture(model) as cap:
        model(input_ids)
    cap.calls        # one KernelCall per (layer, kernel call), in call order

Capture replaces each kernel entry point *at its call site* — the name bound in the fla layer module
(``fla.layers.delta_net.chunk_delta_rule``, ...) — by a wrapper that calls the original with exactly
the same arguments, returns its result untouched, and records the call, tagged with the layer module
that made it (forward pre-/post-hooks on every supported layer). Everything is restored on exit, also
after an exception.

transformers' own delta-rule models (Qwen3-Next, Qwen3.5, Kimi Linear, OLMo-Hybrid) are captured the
same way at the kernel names of their modeling files, whichever implementation those are bound to
(fla's kernel or the file's torch fallback); their layers keep the model's decoder-layer index, and
the full-attention layers are listed in ``Capture.skipped`` (:mod:`.transformers_sites`).

``kernels`` chooses what runs inside the wrapper: ``"fla"`` — fla's Triton kernel; ``"reference"`` —
the package's fp32 reference recurrence, returning the kernel's output format (so an fla model runs
on a machine without a GPU; the other Triton ops on the layer path then need
``TRITON_INTERPRET=1``, see :func:`osdn_diag.runtime.prepare_cpu`); ``"auto"`` — fla on CUDA tensors,
the reference otherwise.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from dataclasses import replace
from collections.abc import Callable

import torch

from . import transformers_sites as hf
from .adapters import ADAPTERS, PHASE1_D, KernelSite, Phase1Site
from .record import TENSOR_FIELDS, KernelCall

__all__ = ["SUPPORTED_FLA", "SUPPORTED_LAYERS", "Capture", "capture"]

SUPPORTED_FLA = ("0.6.0",)
#: fla layer classes whose kernel calls are captured: (module, class name).
SUPPORTED_LAYERS = (
    ("fla.layers.delta_net", "DeltaNet"),
    ("fla.layers.gated_deltanet", "GatedDeltaNet"),
    ("fla.layers.kda", "KimiDeltaAttention"),
    ("fla.layers.precond_gated_deltanet", "PrecondGatedDeltaNet"),
    ("fla.layers.precond_kda", "PrecondKDA"),
    ("fla.layers.gated_deltaproduct", "GatedDeltaProduct"),
    ("fla.layers.momentum_deltanet", "MomentumDeltaNet"),
    ("fla.layers.rwkv7", "RWKV7Attention"),
    ("osdn_diag.layers.osdn", "OSDN"),
    ("osdn_diag.layers.osgdn", "OSGDN"),
    ("fla.layers.comba", "Comba"),
    ("fla.layers.gdn2", "GatedDeltaNet2"),
)


#: fla layers among :data:`SUPPORTED_LAYERS` that run a padded batch padded (they mask their inputs
#: instead of unpadding to ``cu_seqlens``): capture keeps their attention mask and unpads their records.
PADDED_LAYERS = (
    ("fla.layers.rwkv7", "RWKV7Attention"),
)


def _loaded_classes(names: tuple[tuple[str, str], ...]) -> tuple[type, ...]:
    """The classes ``(module, name)`` of the modules imported so far. A model's layers are instances
    of classes whose modules it imported; the others are not imported here (fla loads lazily:
    :mod:`osdn_diag.runtime.fla_import`)."""
    return tuple(c for c in (getattr(sys.modules.get(m), n, None) for m, n in names) if c is not None)


def _padded_layer_classes() -> tuple[type, ...]:
    return _loaded_classes(PADDED_LAYERS)


def _supported_text() -> str:
    layers = ", ".join(f"{m}.{c}" for m, c in SUPPORTED_LAYERS)
    hf_layers = ", ".join(m.layer_class for m in hf.MODELS)
    return f"fla {' / '.join(SUPPORTED_FLA)}; layers: {layers}; transformers layers: {hf_layers}"


def _check_fla_version() -> None:
    import fla

    version = getattr(fla, "__version__", "unknown")
    if version not in SUPPORTED_FLA:
        raise RuntimeError(
            f"osdn_diag.capture knows the kernels of {_supported_text()}; found fla {version}. "
            "Install flash-linear-attention==0.6.0, or add adapters for this version."
        )


def _layer_classes() -> tuple[type, ...]:
    return _loaded_classes(SUPPORTED_LAYERS) + hf.layer_classes()


def _bind(fn: Callable, args: tuple, kwargs: dict, *, defaults: bool = True) -> dict:
    """The arguments of a call by name, ``**kwargs`` flattened; with ``defaults``, every parameter
    (defaults filled in), else only those the caller gave."""
    sig = inspect.signature(fn)
    bound = sig.bind_partial(*args, **kwargs)
    if defaults:
        bound.apply_defaults()
    kw = dict(bound.arguments)
    for name, param in sig.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in kw:
            kw.update(kw.pop(name))
    return kw


def _check_runnable_here(model: torch.nn.Module) -> None:
    """An fla model on the CPU runs its Triton kernels (norms, convolution, gates) under Triton's
    interpreter, which must be on before triton or fla was imported (:func:`osdn_diag.runtime.prepare`).
    Switch it on where it still can be; where fla was imported first, kernels built for a GPU would
    end the forward deep in Triton ("0 active drivers"): say so here, in one line, with what to do."""
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        return
    if not any(type(m).__module__.startswith("fla.") for m in model.modules()):
        return  # a transformers model's torch code: no Triton kernel runs
    param = next(model.parameters(), None)
    if param is not None and param.device.type != "cpu":
        return
    from .. import runtime
    from ..runtime.interpret import InterpreterUnavailable

    try:
        runtime.prepare("cpu")
    except InterpreterUnavailable:
        raise InterpreterUnavailable(
            "this machine has no GPU, and fla was imported before Triton's interpreter was switched on, so "
            "its kernels were built for a GPU and cannot run; in a new Python process, `import "
            "osdn_diag.models` before importing fla (or set TRITON_INTERPRET=1 in the environment)"
        ) from None


class Capture:
    """The live capture session; see :func:`capture`.

    Attributes:
        calls: the recorded :class:`KernelCall` objects (empty when a ``sink`` consumes them).
        layers: ``[(index, name, module)]`` of the supported layers found in the model (the index:
            the layer's rank among them for an fla model, its decoder-layer index for a
            transformers model).
        skipped: a transformers model's decoder layers that are not captured (full attention).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        kernels: str = "auto",
        sink: Callable[[KernelCall], None] | None = None,
        offload: bool = False,
    ):
        if kernels not in ("auto", "fla", "reference"):
            raise ValueError(f"argument 'kernels': expected 'auto', 'fla' or 'reference', got {kernels!r}")
        _check_fla_version()
        classes = _layer_classes()
        # fla layers are numbered in model order; a transformers model's linear-attention layers
        # keep the model's own decoder-layer index (its full-attention layers are not captured).
        self.layers = [
            (mod.layer_idx if hf.is_transformers_layer(mod) else i, name, mod)
            for i, (name, mod) in enumerate(
                (n, m) for n, m in model.named_modules() if isinstance(m, classes)
            )
        ]
        if not self.layers:
            found = sorted({type(m).__name__ for _, m in model.named_modules() if type(m).__module__.startswith("fla.layers")})
            raise ValueError(
                f"model {type(model).__name__} has no layer capture knows ({_supported_text()})"
                + (f"; its fla layers are: {', '.join(found)}" if found else "")
            )
        #: Decoder layers of a transformers model that are not captured (full attention), as
        #: ``[{"layer": i, "type": ...}]``; empty for an fla model.
        self.skipped: list[dict] = (
            hf.skipped_layers(model, [i for i, _, m in self.layers])
            if any(hf.is_transformers_layer(m) for _, _, m in self.layers) else []
        )
        _check_runnable_here(model)
        self.model = model
        self.kernels = kernels
        self.offload = offload
        self.calls: list[KernelCall] = []
        #: The tokens :meth:`generate` produced, by the forward-pass number of their stream (what
        #: :func:`osdn_diag.replay` appends to a prompt given without them).
        self.generated: dict[int, list[int]] = {}
        self._sink = sink or self.calls.append
        self._current: tuple[int, str] | None = None
        self._forward = -1  # forward passes seen; a pass starts when layer indices stop increasing
        self._last_layer: int | None = None
        self._patched: list[tuple[object, str, Callable]] = []
        self._phase1_d: tuple[tuple[int, str] | None, torch.Tensor] | None = None
        self._hooks: list = []
        self._mask: torch.Tensor | None = None  # the 2-D attention mask a transformers layer got
        self._kernel_calls = 0  # kernel calls intercepted so far (a layer that made none is an error)
        self._calls_before: dict[int, int] = {}
        self.enabled = True

    # -- context management ---------------------------------------------------------------------
    def __enter__(self) -> Capture:
        try:
            for site in ADAPTERS:
                # A kernel is called through the module of the layer that calls it, which the
                # model imported: sites in modules not imported have nothing to patch.
                module = sys.modules.get(site.module)
                original = getattr(module, site.name, None)
                if original is None:
                    continue
                setattr(module, site.name, self._wrap(site, original))
                self._patched.append((module, site.name, original))
            if self.kernels != "fla":
                self._patch_short_conv()
                self._patch_elementwise()
            for site in hf.loaded_sites():
                module = sys.modules[site.module]
                original = getattr(module, site.name, None)
                if original is None:
                    continue
                setattr(module, site.name, self._wrap_transformers(site, original))
                self._patched.append((module, site.name, original))
            self._guard_generate()
            for index, name, mod in self.layers:
                if hf.is_transformers_layer(mod):
                    self._hooks.append(mod.register_forward_pre_hook(self._enter_hf_layer(index, name),
                                                                     with_kwargs=True))
                    self._hooks.append(mod.register_forward_hook(self._leave_hf_layer(index, name)))
                elif isinstance(mod, _padded_layer_classes()):
                    self._hooks.append(mod.register_forward_pre_hook(self._enter_padded_layer(index, name),
                                                                     with_kwargs=True))
                else:
                    self._hooks.append(mod.register_forward_pre_hook(self._enter_layer(index, name)))
                self._hooks.append(mod.register_forward_hook(self._leave_layer, always_call=True))
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for module, name, original in reversed(self._patched):
            if original is _NOT_SET:  # an attribute the capture set on an instance: removed
                delattr(module, name)
            else:
                setattr(module, name, original)
        self._patched.clear()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._current = None
        self._phase1_d = None

    # -- generation -------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedily generate ``max_new_tokens`` tokens after ``input_ids`` (one sequence, ``[1, P]``
        or ``[P]``) and record the prompt and every token it generates as one stream per layer call
        (:mod:`osdn_diag.capture.generation`): one record whose positions run over prompt and tokens,
        ``flags["decode_start"] = P``. Returns the tokens, ``[1, N]``. Raises
        :class:`~osdn_diag.capture.generation.GenerationError` where the model's cache does not carry
        its state from step to step."""
        from .generation import generate

        forward = self._forward + 1
        done = generate(self, input_ids, max_new_tokens)
        self._forward = forward  # the stream is one forward pass, whatever number the steps took
        self._last_layer = None
        self.generated[forward] = [int(t) for t in done.tokens.reshape(-1).tolist()]
        for call in done.calls:
            self._sink(replace(call, forward=forward))
        return done.tokens

    @contextlib.contextmanager
    def collecting(self):
        """Within it, records go to the object it yields (``.take()`` returns and clears them)
        instead of the capture's sink."""
        bag = _Bag()
        sink, self._sink = self._sink, bag.append
        try:
            yield bag
        finally:
            self._sink = sink

    def _guard_generate(self) -> None:
        """``model.generate()`` under capture is refused: its decoding steps would be recorded as
        separate one-token sequences at position 0 (and under transformers 5.x an fla 0.6.0 model
        decodes each from an empty state, silently). :meth:`generate` captures generation."""
        model = self.model
        if not callable(getattr(model, "generate", None)) or "generate" in vars(model):
            return

        def refuse(*args, **kwargs):
            raise RuntimeError(
                f"{type(model).__name__}.generate() under osdn_diag.capture would record each decoding step as a "
                "separate one-token sequence; use cap.generate(input_ids, max_new_tokens) (greedy, the prompt "
                "and its tokens captured as one stream) or `osdn-diag run MODEL --generate N`")

        model.generate = refuse
        self._patched.append((model, "generate", _NOT_SET))

    # -- hooks ------------------------------------------------------------------------------------
    def _enter_layer(self, index: int, name: str):
        def hook(module, args):
            if self._last_layer is None or index <= self._last_layer:
                self._forward += 1
            self._last_layer = index
            self._current = (index, name)

        return hook

    def _enter_padded_layer(self, index: int, name: str):
        """An fla layer that runs a padded batch as it is (:data:`PADDED_LAYERS`): also keep its 2-D
        attention mask, so that its records are unpadded as a transformers layer's are."""
        enter = self._enter_layer(index, name)

        def hook(module, args, kwargs):
            enter(module, args)
            mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
            self._mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

        return hook

    def _leave_layer(self, module, args, output):
        self._current = None
        self._mask = None

    def _enter_hf_layer(self, index: int, name: str):
        """A transformers layer: also keep its 2-D attention mask (the kernel sees the batch padded)
        and the kernel-call count, to check that the layer called a kernel capture intercepts."""
        enter = self._enter_layer(index, name)

        def hook(module, args, kwargs):
            enter(module, args)
            mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
            self._mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
            self._calls_before[index] = self._kernel_calls

        return hook

    def _leave_hf_layer(self, index: int, name: str):
        def hook(module, args, output):
            before = self._calls_before.pop(index, self._kernel_calls)
            if self.enabled and self._kernel_calls == before:
                raise RuntimeError(
                    f"layer {index} ({name}, {type(module).__name__}) ran without calling a kernel capture "
                    "intercepts: its forward was replaced (e.g. by a Hub kernel through kernelize or "
                    "use_kernels=True), so what its recurrence read cannot be recorded; load the model "
                    "without use_kernels"
                )

        return hook

    def _patch_short_conv(self) -> None:
        """Where the reference stands in for the delta-rule kernels on the CPU, fla's short
        convolution runs in torch too (:mod:`osdn_diag.math.short_conv`): under Triton's interpreter
        it cost more than the rest of the forward pass. That covers a prefill that leaves its state
        for decoding and the one-token decoding steps (fla's ``causal_conv1d_update``); calls with a
        carried state of more than one token, or on a GPU, still go to fla."""
        from fla.modules.causal_conv1d import ops

        from ..math.short_conv import (causal_conv1d_final_state, causal_conv1d_reference,
                                       causal_conv1d_step_reference)

        original, original_update = ops.causal_conv1d, ops.causal_conv1d_update

        def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                          activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                          cp_context=None, **kwargs):
            if (weight is None or initial_state is not None or cp_context is not None
                    or not self._use_reference(x)):
                return original(x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
                                output_final_state=output_final_state, activation=activation, backend=backend,
                                cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
                                cp_context=cp_context, **kwargs)
            y = causal_conv1d_reference(x, weight, bias, residual, activation, cu_seqlens)
            final = causal_conv1d_final_state(x, weight.shape[-1], cu_seqlens) if output_final_state else None
            return y, final

        def causal_conv1d_update(x, cache, residual=None, weight=None, bias=None, activation=None):
            if weight is None or cache is None or not self._use_reference(x):
                return original_update(x=x, cache=cache, residual=residual, weight=weight, bias=bias,
                                       activation=activation)
            return causal_conv1d_step_reference(x, cache, weight, bias, residual, activation), cache

        causal_conv1d.__wrapped__ = original
        causal_conv1d_update.__wrapped__ = original_update
        ops.causal_conv1d = causal_conv1d
        ops.causal_conv1d_update = causal_conv1d_update
        self._patched.append((ops, "causal_conv1d", original))
        self._patched.append((ops, "causal_conv1d_update", original_update))

    def _patch_elementwise(self) -> None:
        """Where the reference stands in for the delta-rule kernels on the CPU, fla's fused
        normalisation forward (``layer_norm_fwd``: every RMSNorm / LayerNorm / GroupNorm module and its
        fused residual add) and SwiGLU forward (``swiglu_fwd``: GatedMLP) run in torch too
        (:mod:`osdn_diag.math.elementwise`): under Triton's interpreter they were most of a small language
        model's forward pass. Patched in the modules that define them, whose own functions call them
        by those names; on a GPU, or with ``kernels="fla"``, fla's kernels run."""
        from ..math.elementwise import layer_norm_fwd_reference, swiglu_fwd_reference

        for module_name, name, stand_in in (("fla.modules.norm.layernorm", "layer_norm_fwd", layer_norm_fwd_reference),
                                            ("fla.modules.activations.ops", "swiglu_fwd", swiglu_fwd_reference)):
            module = sys.modules.get(module_name)
            original = getattr(module, name, None)
            if original is None:  # not imported by this model, or another fla
                continue

            def patched(x, *args, _original=original, _stand_in=stand_in, **kwargs):
                return (_stand_in if self._use_reference(x) else _original)(x, *args, **kwargs)

            patched.__wrapped__ = original
            setattr(module, name, patched)
            self._patched.append((module, name, original))

    def _use_reference(self, x: torch.Tensor) -> bool:
        return self.kernels == "reference" or (self.kernels == "auto" and x.device.type != "cuda")

    def _wrap(self, site: KernelSite, original: Callable) -> Callable:
        if isinstance(site.adapter, Phase1Site):
            return self._wrap_phase1(site, original)

        def kernel(*args, **kwargs):
            kw = _bind(original, args, kwargs)
            if "q" not in kw and "r" in kw:  # RWKV's kernels name their queries r
                kw["q"] = kw["r"]
            use_reference = self._use_reference(kw["q"])
            if self._phase1_d is not None:
                # The d of this layer call's phase 1 (OSDN layers), handed to the adapter.
                owner, d = self._phase1_d
                self._phase1_d = None
                if owner == self._current:
                    kw[PHASE1_D] = d
            recording = self.enabled and self._current is not None
            # Every kernel is asked for its fp32 final state (the state fidelity check compares the
            # replay's with it); a caller that did not ask gets None in its place, as before. A fused
            # OSDN kernel also returns its d trajectory, which the record keeps.
            overrides = {}
            if recording and "output_final_state" in kw:
                overrides["output_final_state"] = True
            trajectory = getattr(site.adapter, "trajectory", False)
            if trajectory:
                overrides["return_trajectory"] = True
            if use_reference:  # the reference reads every argument, defaults included
                out = site.adapter.reference({**{n: x for n, x in kw.items() if n != PHASE1_D}, **overrides})
            else:  # fla gets what the caller gave, by name, plus the overrides
                try:
                    out = original(**{**_bind(original, args, kwargs, defaults=False), **overrides})
                except AssertionError as err:
                    if "does not support float32" not in str(err):
                        raise
                    # fla 0.6.0's chunk entry points assert on fp32 inputs: the model's dtype, an
                    # input the user chose, not a fault of the kernel or of this package.
                    where = "" if self._current is None else f"layer {self._current[0]} ({self._current[1]}): "
                    raise ValueError(
                        f"{where}fla's {site.name} refuses float32 inputs ({err}); run the model in bf16 "
                        "(--dtype bf16, on a GPU: Triton's interpreter gets bf16 dot products wrong), "
                        "with prompts of at most 64 tokens (the layer's fused recurrent kernel), or with "
                        "--kernels reference"
                    ) from None
            if trajectory:
                kw[PHASE1_D] = out.d
            if recording:
                mask = self._mask  # set only inside a layer that runs its batch padded
                self._emit(site.adapter, kw, out, kernel=site.name, kernels="reference" if use_reference else "fla",
                           transform=None if mask is None else (lambda call: hf.pack_padded(call, mask)))
            if recording and not kw.get("output_final_state", False):
                out = site.adapter.strip_final_state(out)
            if trajectory and not kw.get("return_trajectory", False):
                out = replace(out, d=None)
            return out

        kernel.__wrapped__ = original
        kernel.__name__ = getattr(original, "__name__", site.name)
        return kernel

    def _emit(self, adapter, kw: dict, out, *, kernel: str, kernels: str, flags: dict | None = None,
              transform: Callable[[KernelCall], KernelCall] | None = None) -> None:
        """Record one kernel call of the current layer and hand it to the sink.

        ``kernels`` is what ran: ``"fla"`` (fla's kernel: the record rebuilds fla's stored tensors with
        fla's own functions), ``"reference"`` (the stand-in) or ``"torch"`` (a transformers model's
        torch fallback)."""
        index, name = self._current
        with torch.no_grad():
            call = adapter.record(kw, out, layer=index, layer_name=name, kernel=kernel, fla=kernels == "fla")
            if transform is not None:
                call = transform(call)
        # A record is data, never part of the model's autograd graph: the forward may run with
        # gradients on (training code, a notebook without no_grad), and a kept graph would hold
        # activations alive and refuse .numpy() later.
        for field_name in TENSOR_FIELDS:
            x = getattr(call, field_name)
            if isinstance(x, torch.Tensor) and x.requires_grad:
                setattr(call, field_name, x.detach())
        call.extra = {n: x.detach() for n, x in call.extra.items()}
        call.flags["kernels"] = kernels
        call.flags["device"] = kw["q"].device.type
        call.flags.update(flags or {})
        call.forward = self._forward
        if self.offload:
            from .store import to_device

            call = to_device(call, "cpu")
        self._sink(call)

    def _wrap_transformers(self, site: hf.HFKernelSite, original: Callable) -> Callable:
        """A kernel name of a transformers modeling file (see :mod:`.transformers_sites`): run what it
        is bound to with the caller's arguments (fla's kernel, the file's torch fallback, or a Hub
        kernel) — or, for an fla-signature kernel where ``kernels`` asks for it, the reference
        stand-in — and record the call with the adapter of what ran."""

        def kernel(*args, **kwargs):
            self._kernel_calls += 1
            device = next((x.device.type for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
            bound = hf.resolve(site, original, device)
            recording = self.enabled and self._current is not None
            ask = {"output_final_state": True} if recording else {}
            if bound.kind == "torch":
                kw = hf.to_fla_names(_bind(bound.fn, args, kwargs))
                adapter, kernels, name = site.fallback, "torch", site.name
            else:
                # As transformers' wrapper hands them on: positional as given, keywords the
                # implementation declares.
                params = inspect.signature(bound.fn).parameters
                kw = _bind(bound.fn, args, {n: x for n, x in kwargs.items() if n in params})
                adapter, name = site.adapter, site.fla_name
                kernels = "reference" if self._use_reference(kw["q"]) else "fla"
            if recording and isinstance(kw.get("initial_state"), torch.Tensor):
                # The layer copies its new state into the cache's buffer in place, which is the
                # tensor passed as the initial state: the record keeps the state as it was.
                kw["initial_state"] = kw["initial_state"].detach().clone()
            if kernels == "reference":
                out = adapter.reference({**kw, **ask})
            else:
                out = original(*args, **{**kwargs, **ask})
            if recording:
                mask = self._mask
                self._emit(adapter, kw, out, kernel=name, kernels=kernels,
                           flags={"implementation": bound.name, "model_type": site.model.model_type},
                           transform=lambda call: hf.pack_padded(call, mask))
                if not kw.get("output_final_state", False):
                    out = adapter.strip_final_state(out)
            return out

        # (the function behind a `kernels` module: what inspect.signature should see)
        kernel.__wrapped__ = hf.kernel_function(original)
        kernel.__name__ = getattr(original, "__name__", site.name)
        return kernel

    def _wrap_phase1(self, site: KernelSite, original: Callable) -> Callable:
        """Phase 1 of an OSDN layer: run it with the trajectory kept, remember ``d`` for the phase-2
        record of the same layer call, and return what the caller asked for."""

        def phase1(*args, **kwargs):
            kw = _bind(original, args, kwargs)
            wanted = bool(kw.get("return_trajectory", False))
            kw["return_trajectory"] = True
            res = site.adapter.reference(kw) if self._use_reference(kw["k"]) else original(**kw)
            if self.enabled and self._current is not None:
                self._phase1_d = (self._current, res.d.detach())
            return res if wanted else res.write_key

        phase1.__wrapped__ = original
        phase1.__name__ = getattr(original, "__name__", site.name)
        return phase1


#: Marks, in ``Capture._patched``, an attribute set on an instance that had none of its own.
_NOT_SET = object()


class _Bag(list):
    """Records collected by :meth:`Capture.collecting`."""

    def take(self) -> list[KernelCall]:
        out = list(self)
        self.clear()
        return out


def capture(
    model: torch.nn.Module,
    *,
    kernels: str = "auto",
    sink: Callable[[KernelCall], None] | None = None,
    offload: bool = False,
) -> Capture:
    """Capture the delta-rule kernel calls of ``model`` (use as a context manager).

    Args:
        model: an fla model or layer (fla 0.6.0; see :data:`SUPPORTED_LAYERS`), or a transformers
            model of :data:`osdn_diag.capture.transformers_sites.MODELS`.
        kernels: ``"auto"`` | ``"fla"`` | ``"reference"`` — see the module docstring.
        sink: called with each :class:`KernelCall` instead of keeping it in ``Capture.calls``
            (e.g. to stream it to disk).
        offload: move each record to host memory as soon as it is made (default: keep it on the
            model's device, the cheapest while the forward runs).
    """
    return Capture(model, kernels=kernels, sink=sink, offload=offload)
