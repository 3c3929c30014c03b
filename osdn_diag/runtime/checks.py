"""Argument validation shared by the public functions.

Every check raises ``ValueError`` whose message names the argument and what was expected, so that a
researcher calling ``osdn_phase1(k=..., beta=...)`` with a transposed tensor learns which one it was.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "check_box",
    "check_cu_seqlens",
    "check_cu_seqlens_layout",
    "check_finite",
    "check_shape",
    "check_tensor",
]


def check_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"argument {name!r}: expected a torch.Tensor, got {type(x).__name__}")
    if not (x.is_floating_point() or name == "cu_seqlens"):
        raise ValueError(f"argument {name!r}: expected a floating-point tensor, got dtype {x.dtype}")
    return x


def check_shape(name: str, x: torch.Tensor, expected: Sequence[int | None], layout: str) -> None:
    """Check ``x.shape`` against ``expected`` (``None`` matches any size); ``layout`` names the axes."""
    ok = x.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, x.shape))
    if not ok:
        want = ", ".join("*" if e is None else str(e) for e in expected)
        raise ValueError(
            f"argument {name!r}: expected shape {layout} = [{want}], got {list(x.shape)}"
        )


def check_recurrence_inputs(q, k, v, beta, write_key=None, g=None, device=None,
                            initial_state=None) -> tuple[int, int, int, int, int]:
    """The per-token inputs of a delta-rule recurrence: floating-point tensors ``q, k: [B, T, H, K]``,
    ``v: [B, T, H, V]``, ``beta: [B, T, H]``, ``write_key: [B, T, H, K]`` and ``g: [B, T, H]`` or
    ``[B, T, H, K]`` where given, all on ``device`` where given (a kernel would read another
    device's memory through its pointer), ``initial_state`` too (its shape, which needs the number of
    sequences, is the caller's to check). Returns ``(B, T, H, K, V)``; reads no values (no device
    synchronisation)."""
    named = [("q", q), ("k", k), ("v", v), ("beta", beta), ("write_key", write_key), ("g", g),
             ("initial_state", initial_state)]
    for name, x in named:
        if x is not None or name in ("q", "k", "v", "beta"):
            check_tensor(name, x)
    if k.dim() != 4:
        check_shape("k", k, [None] * 4, "[B, T, H, K]")
    B, T, H, K = k.shape
    check_shape("q", q, [B, T, H, K], "[B, T, H, K]")
    check_shape("v", v, [B, T, H, None], "[B, T, H, V]")
    check_shape("beta", beta, [B, T, H], "[B, T, H]")
    if write_key is not None:
        check_shape("write_key", write_key, [B, T, H, K], "[B, T, H, K]")
    if g is not None:
        if g.dim() == 3:
            check_shape("g", g, [B, T, H], "[B, T, H]")
        else:
            check_shape("g", g, [B, T, H, K], "[B, T, H] or [B, T, H, K]")
    if device is not None:
        for name, x in named:
            if x is not None and x.device != torch.device(device):
                raise ValueError(f"argument {name!r}: expected a tensor on {device} like q, got {x.device}")
    return B, T, H, K, v.shape[-1]


def check_finite(name: str, x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"argument {name!r}: expected finite values, found {bad} NaN/Inf entries")


def check_box(d_min: float | None, d_max: float | None) -> None:
    if (d_min is None) != (d_max is None):
        raise ValueError("arguments 'd_min'/'d_max': give both bounds of the box, or neither")
    if d_min is None:
        return
    if not d_min > 0:
        raise ValueError(f"argument 'd_min': expected d_min > 0, got {d_min}")
    if not d_max >= d_min:
        raise ValueError(f"argument 'd_max': expected d_max >= d_min = {d_min}, got {d_max}")


#: ``cu_seqlens`` dtypes: what fla and our kernels are run with (they load the offsets as integers).
CU_SEQLENS_DTYPES = (torch.int32, torch.int64)


def check_cu_seqlens_layout(
    cu_seqlens: object, batch: int, device: torch.device | None = None
) -> int:
    """Check what can be checked of packed offsets without reading them: a 1-D int32/int64 tensor of at
    least two entries, on ``device`` (if given; the kernels' tensors' device), with batch size 1.
    Returns the number of sequences N. No device synchronisation."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(
            "argument 'cu_seqlens': expected a 1-D integer tensor [0, t_1, ..., T], got "
            f"{type(cu_seqlens).__name__}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in CU_SEQLENS_DTYPES:
        raise ValueError(
            "argument 'cu_seqlens': expected a 1-D int32 or int64 tensor [0, t_1, ..., T] with at "
            f"least two entries, got shape {list(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}"
        )
    if device is not None and cu_seqlens.device != torch.device(device):
        # A kernel would read the offsets through a pointer into the wrong memory.
        raise ValueError(
            f"argument 'cu_seqlens': expected a tensor on {device} like the other inputs, got "
            f"{cu_seqlens.device}; move it there (cu_seqlens.to({str(device)!r}))"
        )
    if batch != 1:
        raise ValueError(
            f"argument 'cu_seqlens': packed sequences need batch size 1 (got B = {batch}); "
            "concatenate the sequences along T"
        )
    return cu_seqlens.numel() - 1


def check_cu_seqlens(
    cu_seqlens: object, batch: int, total: int, device: torch.device | None = None
) -> list[int]:
    """Validate fla-style packed offsets ``[0, t_1, ..., T]`` (:func:`check_cu_seqlens_layout`, then
    non-decreasing from 0 to ``total``) and return them as Python ints. Reads the offsets: on a GPU
    this waits for the work queued before it."""
    check_cu_seqlens_layout(cu_seqlens, batch, device)
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(
            f"argument 'cu_seqlens': expected non-decreasing offsets from 0 to T = {total}, "
            f"got {offsets}"
        )
    return offsets
