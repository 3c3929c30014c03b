"""fla's fused normalisation and SwiGLU forward kernels, in torch: the CPU stand-ins capture uses.

``layer_norm_fwd_reference`` is ``fla.modules.norm.layernorm.layer_norm_fwd``, the forward of every
fla ``RMSNorm`` / ``LayerNorm`` / ``GroupNorm`` module (and of their fused residual add). On rows
``x [T, D]`` (row ``t`` of group ``t mod G`` when ``num_groups = G``, whose weight is
``weight[g·D:(g+1)·D]``), in fp32:

    h = x + residual                      (residual optional; kept as ``res_out`` in residual_dtype)
    RMS norm:    y = h · rstd · w + b,    rstd = 1 / √(mean(h²) + eps)
    layer norm:  y = (h − μ) · rstd · w + b,  μ = mean(h),  rstd = 1 / √(mean((h − μ)²) + eps)

returned in ``out_dtype`` (``x``'s by default) with the fp32 ``mean`` (None for RMS norm) and ``rstd``
that fla's backward reads, and ``res_out`` — or ``x`` itself where fla stores no residual, as fla does.

``swiglu_fwd_reference`` is ``fla.modules.activations.ops.swiglu_fwd`` (the activation of fla's
``GatedMLP``): ``z = x · sigmoid(x) · y`` in fp32, returned in ``x``'s dtype.

Under Triton's interpreter these two kernels were most of a small fla language model's forward pass on
the CPU (43 of 53 s of ``osdn-diag demo --lm``: the interpreter runs each program of the grid in
Python). Capture puts these in their place wherever the package's reference recurrence stands in for
the delta-rule kernels (``kernels="reference"``, the CPU by default), as it does for the short
convolution (:mod:`osdn_diag.math.short_conv`).
"""

from __future__ import annotations

import torch

__all__ = ["layer_norm_fwd_reference", "swiglu_fwd_reference"]


def layer_norm_fwd_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    residual_dtype: torch.dtype | None = None,
    is_rms_norm: bool = False,
    num_groups: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(y [T, D], mean [T] fp32 or None, rstd [T] fp32, res_out [T, D])`` of ``x [T, D]``, fla's
    ``layer_norm_fwd`` signature and return (see the module docstring)."""
    if x.dim() != 2:
        raise ValueError(f"x: expected [T, D] rows, got shape {tuple(x.shape)}")
    T, D = x.shape
    G = num_groups
    if residual is not None:
        residual_dtype = residual.dtype
        if residual.shape != x.shape:
            raise ValueError(f"residual: expected shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    h = x.float()
    if residual is not None:
        h = h + residual.float()
    # fla stores the sum only when there is a residual or it was asked for in another dtype
    store = residual is not None or (residual_dtype is not None and residual_dtype != x.dtype)
    res_out = h.to(residual_dtype) if store else x
    if is_rms_norm:
        mean = None
        centred = h
    else:
        mean = h.sum(dim=-1) / D
        centred = h - mean[:, None]
    rstd = 1.0 / torch.sqrt((centred * centred).sum(dim=-1) / D + eps)
    y = centred * rstd[:, None]
    group = torch.arange(T, device=x.device) % G if G > 1 else None

    def per_row(p: torch.Tensor) -> torch.Tensor:
        p = p.float().view(G, D)
        return p[group] if group is not None else p[0]

    if weight is not None:
        y = y * per_row(weight)
    if bias is not None:
        y = y + per_row(bias)
    return y.to(x.dtype if out_dtype is None else out_dtype), mean, rstd, res_out


def swiglu_fwd_reference(x: torch.Tensor, y: torch.Tensor, output_contiguous: bool = False) -> torch.Tensor:
    """``x · sigmoid(x) · y`` elementwise for ``x``, ``y`` of one shape, computed in fp32 and returned in
    ``x``'s dtype (fla's ``swiglu_fwd``; the result is always a new contiguous tensor)."""
    if x.shape != y.shape:
        raise ValueError(f"swiglu: x and y differ in shape, {tuple(x.shape)} and {tuple(y.shape)}")
    xf = x.float()
    return (xf * torch.sigmoid(xf) * y.float()).to(x.dtype).contiguous()
