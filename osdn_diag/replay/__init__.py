"""Replay: the second stage of the data flow (capture → **replay** → metrics → report).

It takes what :mod:`osdn_diag.capture` recorded — each kernel call's inputs, output and final state —
recomputes every write in fp32 (or fp64), checks itself against the kernel, and measures each write's
residual ratio; the statistics it accumulates come from :mod:`osdn_diag.metrics`, and
:mod:`osdn_diag.report` and :mod:`osdn_diag.plot` read what it produces.

* :mod:`.call` — one kernel call: :func:`replay_call` (the recurrence, the per-token losses and
  ratios, the output and final-state fidelity checks, NaN/Inf streams).
* :mod:`.replayer` — a run's calls one after another: :class:`Replayer` turns each into rows of the
  per-token table (:data:`CONTRACT_COLUMNS`) and keeps every accumulator of the summary.
* :mod:`.results` — :class:`Results`, in memory (:func:`replay`) or from a run directory
  (:meth:`Results.load`, :func:`load_run`).

The package is callable: ``osdn_diag.replay(cap)`` is :func:`replay`.
"""

from __future__ import annotations

from ..runtime.lazy import lazy_names

__all__ = [
    "CONTRACT_COLUMNS",
    "DEFAULT_TOLERANCE",
    "STATE_TOLERANCE",
    "CallReplay",
    "FidelityError",
    "Replayer",
    "Results",
    "default_state_tolerance",
    "default_tolerance",
    "load_run",
    "replay",
    "replay_call",
    "working_precision",
]

#: Where each name lives: loaded on first use, so that reading a finished run (``load_run``, what
#: ``osdn-diag report`` needs) does not import torch.
_HOME = {
    **dict.fromkeys(("DEFAULT_TOLERANCE", "STATE_TOLERANCE", "CallReplay", "FidelityError",
                     "default_state_tolerance", "default_tolerance", "replay_call", "working_precision"), "call"),
    "CONTRACT_COLUMNS": "runs", "load_run": "runs", "Replayer": "replayer", "Results": "results",
    "replay": "results",
}


__getattr__, __dir__ = lazy_names(__name__, _HOME)

from ..runtime.callable_module import make_callable  # noqa: E402

make_callable(__name__, "replay")
