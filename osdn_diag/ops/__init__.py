"""Triton kernels, each beside the plain-torch reference it is tested against (:mod:`osdn_diag.math`).

The public ops, importable from here (``from osdn_diag.ops import chunk_osdn``):

* :func:`osdn_precondition` (:mod:`.phase1`) — OSDN phase 1: the preconditioner sweep over keys
  ``k: [B, T, H, K]`` and ``beta: [B, T, H]``, giving ``d`` and the write keys ``d ⊙ k``; forward and
  backward.
* :func:`chunk_osdn` (:mod:`.osdn_chunk`) — OSDN / OSGDN phase 2, the chunked delta rule with read
  key ``k`` and write key ``d ⊙ k`` (optional log decay ``g``), forward and backward.
* :func:`fused_recurrent_osdn` (:mod:`.osdn_recurrent`) — both phases in one recurrent kernel
  (inference, decoding).
* :func:`fused_replay` (:mod:`.replay`) — the diagnostic's replay: the recurrence with both residual
  norms of every write, fp32.
* :func:`chunk_replay` (:mod:`.replay_chunk`) — the same replay a chunk of tokens at a time on tensor
  cores (3×TF32), ungated or head-gated, K ≤ 128; the diagnostic's Triton replay where it applies,
  ``fused_replay`` elsewhere (:func:`osdn_diag.replay.call.triton_replay`, ``docs/performance.md``).

Each states its shapes, dtypes and devices in its docstring. They are loaded on first access: the
modules import triton and fla, which on a machine without a GPU must wait until
``TRITON_INTERPRET=1`` is set (:func:`osdn_diag.runtime.prepare`).
"""

from __future__ import annotations

from ..runtime.lazy import lazy_names

_PUBLIC = {
    "osdn_precondition": "phase1",
    "chunk_osdn": "osdn_chunk",
    "fused_recurrent_osdn": "osdn_recurrent",
    "fused_replay": "replay",
    "chunk_replay": "replay_chunk",
}

__all__ = sorted(_PUBLIC)


__getattr__, __dir__ = lazy_names(__name__, _PUBLIC)
