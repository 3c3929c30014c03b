"""Replay of RWKV-7's generalised delta rule (fla's ``RWKV7Attention``).

``S_t = S_{t−1}(Diag(exp(w_t)) − κ̂_t b_tᵀ) + v_t k_tᵀ`` erases along the removal key κ̂_t and writes
along the write key k_t, so the delta-rule replay cannot stand in. The torch reference
(:func:`osdn_diag.math.family_rwkv7.rwkv7_recurrence`) serves both backends (``"triton"`` runs it
too; there is no fused replay kernel for this family).

The loss read by ``loss_before`` / ``loss_after`` / ``residual_ratio`` is on the removal key κ̂_t
(the record's ``k``); :data:`COLUMNS`' ``residual_ratio_alt`` is the same ratio on the write key k_t
(the record's ``write_key``), ``½‖S_t k_t − v_t‖² / ½‖S_{t−1} k_t − v_t‖²`` (1 where the loss before is
0). docs/families.md says why.

The update drives the prediction along κ̂_t toward its own target ``(c_k/c_b) v_t``
(:mod:`osdn_diag.math.family_rwkv7`), not toward ``v_t``: ``own_target_ratio`` (and
``own_target_ratio_post``, against the decayed state) is the ratio of the loss toward that target,
``target_scale`` the factor ``c_k/c_b``. ``residual_ratio`` stays the ratio toward ``v_t``, the
regression target every family shares, so it is the one that compares with the delta rules.
"""

from __future__ import annotations

import torch

from ...capture.record import KernelCall
from ...math.closed_forms import residual_ratio
from ...math.family_rwkv7 import rwkv7_recurrence
from ...math.recurrence import RecurrenceResult
from ..call import zero_nonfinite

__all__ = ["COLUMNS", "REPLAYS", "replay"]

FAMILY = "rwkv7"
#: Shared with other families whose removal and write keys differ; per family docs/families.md says
#: which key it reads.
COLUMNS: tuple[str, ...] = ("residual_ratio_alt", "own_target_ratio", "own_target_ratio_post", "target_scale")

#: Summary figures (:func:`osdn_diag.replay.families.figures`): ``q_geo_own_target`` is the geometric
#: mean of ``own_target_ratio`` (``post_decay``: of ``own_target_ratio_post``) over a family's tokens.
FIGURES = {"own_target": ("own_target_ratio", "own_target_ratio_post")}


def replay(call: KernelCall, *, dtype: torch.dtype, bad: torch.Tensor | None, backend: str) -> RecurrenceResult:
    """Recompute the state for every token of ``call`` (both backends: the torch reference)."""
    del backend  # one reference for both
    xs = [call.q, call.k, call.extra["b"], call.write_key, call.v, call.g]
    S0 = call.initial_state
    if bad is not None:
        xs = [zero_nonfinite(x, bad) for x in xs]
        S0 = None if S0 is None else torch.nan_to_num(S0, nan=0.0, posinf=0.0, neginf=0.0)
    res = rwkv7_recurrence(*xs, scale=call.scale, initial_state=S0, cu_seqlens=call.cu_seqlens, dtype=dtype)
    before_alt, after_alt = res.columns.pop("loss_before_alt"), res.columns.pop("loss_after_alt")
    res.columns["residual_ratio_alt"] = residual_ratio(after_alt, before_alt)
    before_own, after_own = res.columns.pop("loss_before_own"), res.columns.pop("loss_after_own")
    before_own_dec = res.columns.pop("loss_before_own_decayed")
    # residual_ratio keeps NaN where the target is undefined (c_b = 0): NaN losses compare false.
    res.columns["own_target_ratio"] = residual_ratio(after_own, before_own)
    res.columns["own_target_ratio_post"] = residual_ratio(after_own, before_own_dec)
    return res


REPLAYS = {FAMILY: replay}
