"""Replays of the kernel families whose recurrence is not the delta rule's, one module per family.

:func:`osdn_diag.replay.call.replay_call` replays a call with the delta-rule recurrence
(:func:`osdn_diag.math.recurrence.delta_rule_recurrence`, or the fused Triton kernel) unless its
``family`` is registered here. Each module listed in :data:`MODULES` defines

* ``REPLAYS: dict[str, Callable]`` — family name → ``replay(call, *, dtype, bad, backend)``,
  returning a :class:`osdn_diag.math.recurrence.RecurrenceResult` in the call's layout (``o``,
  ``final_state`` ``[N, H, V, K]``, ``loss_before``, ``loss_after``, ``write_gain``, and
  ``loss_before_decayed`` for gated families). ``bad`` is ``None`` or the ``[B, T, H]`` mask of
  tokens with non-finite inputs, to be replayed on zeros (:func:`osdn_diag.replay.call.zero_nonfinite`).
  ``backend`` is ``"torch"`` or ``"triton"``; a family without a Triton replay runs its torch
  reference for both, and says so in its docs;
* ``COLUMNS: tuple[str | tuple[str, str], ...]`` — the further per-token value columns its replays
  return in ``RecurrenceResult.columns`` (``[B, T, H]`` each). A run's table has those of its layers'
  families (null on the rows of its other layers) and leaves the others out
  (:func:`osdn_diag.replay.replayer.filled_schema`).
  An entry is a column name (stored in the replay's value type, float32 or float64) or a pair
  ``(name, arrow type name)`` such as ``("step", "int32")`` for a column of another type
  (:func:`column_types`); plain names keep working as before;
* optionally ``FIGURES: dict[str, tuple[str, str]]`` — summary figures of the family's own:
  ``name → (column, post-decay column)``; the summary's ``by_family`` entry of every family whose
  layers fill ``column`` gets ``q_geo_<name>`` and ``n_<name>``, the geometric mean (with the
  summary's floor) and count of the column's finite values, and its ``post_decay`` entry the same of
  the post-decay column (:func:`figures`);
* optionally ``HINTS: dict[str, Callable]`` — family name → ``hint(call) -> str | None``: what to add
  to a failed output check's message (a known limit of the family's kernel, and what to do).

docs/families.md states each family's recurrence and the token-local loss its ratio measures.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache

__all__ = ["MICRO_STEP_FAMILIES", "MODULES", "NOT_APPLICABLE", "column_types", "columns", "figures", "hints", "replays"]

#: Families whose write is not a delta-rule write along the loss's read key, so that swapping in
#: ``d ⊙ k`` as the write key is not "the same writes under OSDN's preconditioner" (at η = 0 it would
#: not even reproduce the model): what-if refuses their runs, and so does the retention probe
#: (``--retained``), which replays delta-rule writes (docs/families.md says why, per family).
NOT_APPLICABLE: dict[str, str] = {
    "comba": "Comba writes along k and removes along p, against the undecayed state",
    "gdn2": "GDN-2 writes along k, not along its read key b ⊙ k",
    "momentum_delta_rule": "MomentumDeltaNet writes through a momentum buffer",
    "rwkv7": "RWKV-7 writes v kᵀ along a key other than its removal key",
}

#: Families that make several writes (micro-steps) per token, one row each: their ``residual_ratio``,
#: and so ``q_geo``, ``q_arith`` and ``n``, are per micro-step; ``token_ratio`` (on the ``step = 0``
#: rows) is the token's product of them (docs/families.md, GatedDeltaProduct).
MICRO_STEP_FAMILIES: frozenset[str] = frozenset({"gated_delta_product"})

#: The family modules, in the order their columns are listed.
MODULES: tuple[str, ...] = ("comba", "gated_deltaproduct", "momentum_delta_rule", "rwkv7")


def _modules():
    return [importlib.import_module(f".{name}", __name__) for name in MODULES]


@cache
def replays() -> dict[str, Callable]:
    """Every registered family's replay function, by family name."""
    out: dict[str, Callable] = {}
    for module in _modules():
        out.update(module.REPLAYS)
    return out


@cache
def columns() -> tuple[str, ...]:
    """Every registered family's further per-token value columns, in :data:`MODULES` order."""
    out: list[str] = []
    for module in _modules():
        out.extend(n for n in map(_column_name, module.COLUMNS) if n not in out)
    return tuple(out)


def _column_name(entry) -> str:
    return entry if isinstance(entry, str) else entry[0]


@cache
def column_types() -> dict[str, str]:
    """The registered columns that declare an arrow type (``(name, type)`` entries of ``COLUMNS``):
    name → arrow type name (e.g. ``"int32"``). Columns not listed take the replay's value type."""
    out: dict[str, str] = {}
    for module in _modules():
        for entry in module.COLUMNS:
            if not isinstance(entry, str):
                out.setdefault(entry[0], str(entry[1]))
    return out


@cache
def hints() -> dict[str, Callable]:
    """Every registered family's fidelity hint, by family name (families without one are absent)."""
    out: dict[str, Callable] = {}
    for module in _modules():
        out.update(getattr(module, "HINTS", {}))
    return out


@cache
def figures() -> dict[str, tuple[str, str]]:
    """Every registered family's summary figures: name → (column, post-decay column)."""
    out: dict[str, tuple[str, str]] = {}
    for module in _modules():
        out.update(getattr(module, "FIGURES", {}))
    return out
