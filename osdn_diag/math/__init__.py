"""Reference mathematics: plain torch, fp64-capable, the ground truth every fast path is checked against.

* :mod:`~osdn_diag.math.recurrence` — token-by-token write recurrences with per-token losses.
* :mod:`~osdn_diag.math.chunk` — the chunkwise WY form of the same recurrences.
* :mod:`~osdn_diag.math.phase1` — the OSDN preconditioner sweep (Algorithm 1).
* :mod:`~osdn_diag.math.closed_forms` — Lemma 4.1, Lemma D.6 and Theorem D.7 in closed form.
"""

from .chunk import chunk_delta_rule
from .closed_forms import (
    comparator_gap,
    log_bound,
    regret,
    residual_ratio,
    surrogate,
    surrogate_grad,
    surrogate_hessian,
    write_gain,
)
from .phase1 import Phase1Result, osdn_phase1
from .recurrence import (
    RecurrenceResult,
    delta_rule_recurrence,
    deltanet,
    gated_deltanet,
    kda,
    osdn,
    osgdn,
    oskda,
)

__all__ = [
    "Phase1Result",
    "RecurrenceResult",
    "chunk_delta_rule",
    "comparator_gap",
    "delta_rule_recurrence",
    "deltanet",
    "gated_deltanet",
    "kda",
    "log_bound",
    "osdn",
    "osdn_phase1",
    "osgdn",
    "oskda",
    "regret",
    "residual_ratio",
    "surrogate",
    "surrogate_grad",
    "surrogate_hessian",
    "write_gain",
]
