"""Tiny random transformers models for the capture tests, built offline from the package's
``random:*-tiny`` presets, with the depth a test asks for."""

from __future__ import annotations

import contextlib
import sys

import torch

from osdn_diag.catalog.presets import TRANSFORMERS_PRESETS

#: preset name, modeling module, the kernel names its linear-attention layer calls (prompt, decode step)
MODELS = {
    "qwen3_next": ("qwen3-next-tiny", "transformers.models.qwen3_next.modeling_qwen3_next",
                   ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")),
    "qwen3_5": ("qwen3.5-tiny", "transformers.models.qwen3_5.modeling_qwen3_5",
                ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")),
    "qwen3_5_moe": ("qwen3.5-moe-tiny", "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
                    ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")),
    "kimi_linear": ("kimi-linear-tiny", "transformers.models.kimi_linear.modeling_kimi_linear",
                    ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")),
    "olmo_hybrid": ("olmo-hybrid-tiny", "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
                    ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")),
}
FLA_NAMES = {
    "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
    "chunk_kimi_delta_attention": "chunk_kda",
    "recurrent_kimi_delta_attention": "fused_recurrent_kda",
}


def tiny_model(model: str, layer_types: tuple[str, ...], *, seed: int = 0, dtype=torch.float32,
               device: str = "cpu", **overrides) -> torch.nn.Module:
    """The ``model`` preset with ``len(layer_types)`` decoder layers of those types, eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    cls_name, kwargs = TRANSFORMERS_PRESETS[MODELS[model][0]]
    kwargs = {**kwargs, "num_hidden_layers": len(layer_types), "layer_types": list(layer_types), **overrides}
    if "mlp_layer_types" in kwargs:  # Kimi: a dense MLP first, experts after
        kwargs["mlp_layer_types"] = (["dense"] + ["sparse"] * len(layer_types))[: len(layer_types)]
    config = getattr(transformers, cls_name)(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = AutoModelForCausalLM.from_config(config)
    return net.to(device=device, dtype=dtype).eval()


def fallback_bound(model: str) -> dict:
    """``{kernel name: the object transformers binds to it when fla cannot be imported}``: the
    modeling file's torch functions run through transformers' own wrapper, built with fla hidden."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    from osdn_diag.capture.transformers_sites import kernel_function

    module = sys.modules[MODELS[model][1]]
    out = {}
    for name in MODELS[model][2]:
        # functools.wraps keeps the torch function (under the `kernels` package's module, if any)
        torch_fn = kernel_function(getattr(module, name)).__wrapped__
        with hidden_module("fla"):
            out[name] = use_kernel_func_from_hub_with_fallback(FLA_NAMES[name], "fla")(torch_fn)
    return out


def torch_on_cpu(model: str) -> bool:
    """Whether transformers runs ``model``'s modeling-file torch functions on a CPU even with fla
    installed (5.25 and later, whose wrapper lists the devices fla runs on), rather than fla's
    kernels (earlier). The modeling module must be imported."""
    from osdn_diag.capture import transformers_sites as hf

    bound = getattr(sys.modules[MODELS[model][1]], MODELS[model][2][0])
    return "supported_devices" in hf._closure(hf.kernel_function(bound))


@contextlib.contextmanager
def fla_on_cpu(model: str):
    """From transformers 5.25 a kernel name runs the modeling file's torch function on inputs on a
    device fla is not listed for, the CPU among them. Inside, the CPU is listed, so that fla's
    kernels run there (under Triton's interpreter) as they would on a GPU. Earlier transformers
    have no list: nothing changes."""
    from osdn_diag.capture.transformers_sites import kernel_function

    module = sys.modules[MODELS[model][1]]
    changed = []
    for name in MODELS[model][2]:
        fn = kernel_function(getattr(module, name))
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            if var == "supported_devices" and cell.cell_contents is not None:
                changed.append((cell, cell.cell_contents))
                cell.cell_contents = (*cell.cell_contents, "cpu")
    try:
        yield
    finally:
        for cell, devices in changed:
            cell.cell_contents = devices


@contextlib.contextmanager
def hidden_module(name: str):
    """``import name`` fails inside (and its submodules too)."""
    saved = {k: v for k, v in sys.modules.items() if k == name or k.startswith(name + ".")}
    for k in saved:
        sys.modules[k] = None
    sys.modules[name] = None
    try:
        yield
    finally:
        for k in list(sys.modules):
            if (k == name or k.startswith(name + ".")) and sys.modules[k] is None:
                del sys.modules[k]
        sys.modules.update(saved)


def decode_step(net, step: torch.Tensor, cache):
    """One cached decoding step: the cache goes by the keyword this transformers version's forward
    takes (``cache`` in recent 5.x, ``past_key_values`` before), so the step really decodes — a
    keyword the forward does not know would drop the cache and re-run the chunk path."""
    import inspect

    params = inspect.signature(net.forward).parameters
    key = "cache" if "cache" in params else "past_key_values"
    return net(step, **{key: cache}, use_cache=True)
