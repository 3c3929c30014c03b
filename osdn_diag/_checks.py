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


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, total: int) -> list[int]:
    """Validate fla-style packed offsets ``[0, t_1, ..., T]`` and return them as Python ints."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(
            "argument 'cu_seqlens': expected a 1-D integer tensor [0, t_1, ..., T], got "
            f"{type(cu_seqlens).__name__}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(
            "argument 'cu_seqlens': expected a 1-D integer tensor [0, t_1, ..., T] with at least "
            f"two entries, got shape {list(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}"
        )
    if batch != 1:
        raise ValueError(
            f"argument 'cu_seqlens': packed sequences need batch size 1 (got B = {batch}); "
            "concatenate the sequences along T"
        )
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(
            f"argument 'cu_seqlens': expected non-decreasing offsets from 0 to T = {total}, "
            f"got {offsets}"
        )
    return offsets
