"""The depthwise causal short convolution of fla's layers (``fla.modules.ShortConvolution``), in torch.

fla computes, per sequence and channel ``d`` (weights ``w [D, W]``, optional ``bias [D]``),

    y[t, d] = act(Σ_{j=0}^{W-1} w[d, j] · x[t − (W − 1) + j, d] + bias[d]) + residual[t, d]

with ``x`` taken as zero before the sequence's first token (no carried state), ``act`` SiLU or the
identity, accumulated in fp32 and returned in ``x``'s dtype. With ``cu_seqlens`` (``x`` is ``[1, T, D]``,
sequences packed) no sequence sees another's tokens.

Capture uses this on the CPU in place of fla's Triton kernel where the package's reference stands in
for the delta-rule kernels (``kernels="reference"``): under Triton's interpreter the convolution was
the larger part of a language model's forward pass (31 of 45 s for a 4-layer model on 8 prompts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_reference"]


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [B, T, D]`` of ``x [B, T, D]`` (``B = 1`` with ``cu_seqlens [N + 1]``), ``weight [D, W]``.

    ``activation`` is ``None``, ``"silu"`` or ``"swish"`` (the same function); ``residual`` is added after
    it. Differentiable (plain torch), so it also serves training on a CPU.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"argument 'activation': expected None, 'silu' or 'swish', got {activation!r}")
    B, T, D = x.shape
    W = weight.shape[-1]
    if weight.shape != (D, W):
        raise ValueError(f"argument 'weight': expected shape [{D}, W] for x of shape {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"argument 'x': packed sequences (cu_seqlens) need a batch of 1, got {B}")
    # Tap by tap, in fla's order (j = 0 … W − 1: the oldest input first), one product and one addition
    # each in fp32: elementwise work, so a token's output does not depend on where it sits in a packed
    # batch (a library convolution picks its algorithm, and its rounding, by the tensor's shape).
    xf, wf = x.float(), weight.float()
    t = torch.arange(T, device=x.device)
    if cu_seqlens is None:
        first = torch.zeros(T, dtype=torch.long, device=x.device)  # each row's sequence starts at 0
    else:
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        first = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1])  # [T]: where each token's sequence starts
    y = torch.zeros_like(xf)
    for j in range(W):
        lag = W - 1 - j  # tap j reads x[t − lag]
        shifted = F.pad(xf, (0, 0, lag, 0))[:, :T] if lag else xf
        inside = (t - lag >= first)[None, :, None]  # zero before the sequence's first token (where, not
        y = y + torch.where(inside, shifted, 0.0) * wf[:, j]  # a product: NaN must not cross sequences)
    if bias is not None:
        y = y + bias.float()
    if activation is not None:
        y = y * torch.sigmoid(y)
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)
