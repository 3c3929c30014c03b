"""What the kernels of :mod:`osdn_diag.ops` share: Triton pieces of the per-(sequence, head) kernels, and
the replays' launch checks and results."""

from __future__ import annotations

import math
import operator

import torch
import triton
import triton.language as tl

from ..math.recurrence import RecurrenceResult


def as_int(value) -> int | None:
    """``value`` as an int where it is one (numpy's ints included, but not a bool), else ``None``."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def int_in_range(op: str, name: str, value, low: int, high: int) -> int:
    """A launch option ``value`` checked: an int (:func:`as_int`) from ``low`` to ``high``.
    ``ValueError`` names ``op`` and ``name``."""
    n = as_int(value)
    if n is None or not low <= n <= high:
        raise ValueError(f"{op}: {name} must be an int from {low} to {high}, got {value!r}")
    return n


def finite_scale(op: str, scale) -> float | None:
    """The read-out's ``scale`` checked: ``None`` (the op's default, ``K^-1/2``) or a finite number.
    NaN or ±inf made every read-out non-finite, silently; they and anything that is not a number are
    refused (``ValueError`` naming ``op`` and the argument), before any kernel runs."""
    if scale is None:
        return None
    try:
        value = float(scale)
    except (TypeError, ValueError):
        value = math.nan
    if not math.isfinite(value):
        raise ValueError(f"{op}: scale must be a finite number (or None: K^-1/2), got {scale!r}")
    return value


def power_of_two(op: str, name: str, value, low: int = 1, high: int | None = None) -> int:
    """A launch option ``value`` checked: an int (:func:`as_int`), a power of two, from ``low`` to
    ``high`` where given. ``ValueError`` names ``op`` and ``name``."""
    n = as_int(value)
    if n is None or n < low or (high is not None and n > high) or n & (n - 1):
        bounds = "" if high is None else f" from {low} to {high}"
        raise ValueError(f"{op}: {name} must be a power of two{bounds}, got {value!r}")
    return n


def replay_result(o: torch.Tensor, final_state: torch.Tensor, parts: torch.Tensor, gain: torch.Tensor,
                  gated: bool) -> RecurrenceResult:
    """A replay's result from its kernels' outputs: ``parts`` ``[3, B·T·H, NV]`` holds each V-block's
    share of ``loss_before``, ``loss_before_decayed`` and ``loss_after``, added here; ``gain`` is
    ``[B, T, H]``. ``loss_before_decayed`` only where the layer has a gate."""
    B, T, H = gain.shape
    before, before_dec, after = (p.sum(-1).view(B, T, H) for p in parts)
    return RecurrenceResult(o=o, final_state=final_state, loss_before=before, loss_after=after, write_gain=gain,
                            loss_before_decayed=before_dec if gated else None)


@triton.jit
def sequence_bounds(cu_seqlens, i_n, T, VARLEN: tl.constexpr):
    """``(bos, eos)``, int64 token offsets of sequence ``i_n``: from fla's ``cu_seqlens`` for packed
    variable-length input, else ``[i_n·T, (i_n+1)·T)``."""
    if VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
    return bos, eos


@triton.jit
def load_d0(d0, i_nh, i_h, o_k, m_k, K: tl.constexpr, BK: tl.constexpr, D0: tl.constexpr, ACC: tl.constexpr):
    """The initial preconditioner of (sequence, head) ``i_nh`` in ``ACC`` over lanes ``o_k``: ones
    (``D0 = 0``), shared per head ``[H, K]`` (1) or per sequence ``[N, H, K]`` (2)."""
    if D0 == 1:
        b_d = tl.load(d0 + i_h * K + o_k, mask=m_k, other=1.0).to(ACC)
    elif D0 == 2:
        b_d = tl.load(d0 + i_nh * K + o_k, mask=m_k, other=1.0).to(ACC)
    else:
        b_d = tl.full([BK], 1.0, dtype=ACC)
    return b_d


@triton.jit
def step_size_terms(b_s, b_beta, eta, eps, BETA_AWARE: tl.constexpr):
    """``(α, γ)`` of one token's phase-1 step size ``c = α − γ ⟨d, s⟩`` (Eq. 7): ``α = η p / max(‖k‖², ε)``
    and ``γ = α p``, with ``p = β`` (beta-aware) or 1 and ``s = k ⊙ k``. Both depend on the token
    alone, which keeps the division off the chain that runs through ``d``."""
    if BETA_AWARE:
        p = b_beta
    else:
        p = 1.0
    alpha = eta * p / tl.maximum(tl.sum(b_s, axis=0), eps)
    return alpha, alpha * p
