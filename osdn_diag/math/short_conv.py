"""The depthwise causal short convolution of fla's layers (``fla.modules.ShortConvolution``), in torch.

fla computes, per sequence and channel ``d`` (weights ``w [D, W]``, optional ``bias [D]``),

    y[t, d] = act(Σ_{j=0}^{W-1} w[d, j] · x[t − (W − 1) + j, d] + bias[d]) + residual[t, d]

with ``x`` taken as zero before the sequence's first token (no carried state), ``act`` SiLU or the
identity, accumulated in fp32 and returned in ``x``'s dtype. With ``cu_seqlens`` (``x`` is ``[1, T, D]``,
sequences packed) no sequence sees another's tokens.

Decoding carries a state: the last ``W`` inputs of each sequence, ``cache [N, D, W]`` in ``x``'s dtype,
the newest at ``W − 1`` (zeros where a sequence had fewer). :func:`causal_conv1d_final_state` is the
state a prefill leaves, :func:`causal_conv1d_step_reference` one decoding step (one token per
sequence), which shifts the new input into the cache in place and convolves the cache — fla's
``causal_conv1d_update``.

Capture uses these on the CPU in place of fla's Triton kernels where the package's reference stands in
for the delta-rule kernels (``kernels="reference"``): under Triton's interpreter the convolution was
the larger part of a language model's forward pass (31 of 45 s for a 4-layer model on 8 prompts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_final_state", "causal_conv1d_reference", "causal_conv1d_step_reference"]


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
    return _finish(y, bias, activation, residual).to(x.dtype)


def _finish(y: torch.Tensor, bias, activation, residual) -> torch.Tensor:
    """The taps' fp32 sum ``y`` plus bias, through the activation, plus the residual (fla's order)."""
    if bias is not None:
        y = y + bias.float()
    if activation is not None:
        y = y * torch.sigmoid(y)
    if residual is not None:
        y = y + residual.reshape(y.shape).float()
    return y


def causal_conv1d_final_state(x: torch.Tensor, width: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The cache ``[N, D, width]`` a prefill of ``x [B, T, D]`` leaves (no carried state before it):
    per sequence its last ``width`` inputs, the newest at ``width − 1``, zeros before its first token."""
    B, T, D = x.shape
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        offs = [int(v) for v in cu_seqlens.tolist()]
        bounds = [(0, s, e) for s, e in zip(offs[:-1], offs[1:])]
    out = x.new_zeros(len(bounds), D, width)
    for n, (row, start, end) in enumerate(bounds):
        take = min(width, end - start)
        if take:
            out[n, :, width - take:] = x[row, end - take:end].transpose(0, 1)
    return out


def causal_conv1d_step_reference(
    x: torch.Tensor,
    cache: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """One decoding step: ``x`` holds one token per sequence (``[N, 1, D]``, ``[1, N, D]`` or
    ``[N, D]``), ``cache [N, D, W]`` the sequences' last ``W`` inputs. Shifts ``x`` into ``cache`` (in
    place, as fla's kernel does) and returns ``y`` of ``x``'s shape: the taps over the new cache in fp32,
    oldest first, then bias, activation and residual as :func:`causal_conv1d_reference`."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"argument 'activation': expected None, 'silu' or 'swish', got {activation!r}")
    N, D, W = cache.shape
    flat = x.reshape(N, D)
    cache.copy_(torch.cat([cache[:, :, 1:], flat[:, :, None].to(cache.dtype)], dim=2))
    wf, cf = weight.float(), cache.float()
    y = torch.zeros(N, D, dtype=torch.float32, device=x.device)
    for j in range(W):
        y = y + cf[:, :, j] * wf[:, j]
    return _finish(y, bias, activation, residual).to(x.dtype).reshape(x.shape)
