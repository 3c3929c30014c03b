"""Metrics over replayed captures: ratio statistics, the assumption audit, retained associations, the
comparator gap ε_T^diag and Theorem D.7's bound."""

from .audit import AuditAccumulator
from .comparator import (
    BoxLSQResult,
    comparator_gap_diag,
    comparator_gap_masked,
    normal_equations,
    solve_box_lsq,
)
from .ratios import Q_FLOOR, RatioAccumulator, RatioStats
from .retention import RetentionAccumulator
from .theorem import COLUMNS as THEOREM_COLUMNS
from .theorem import theorem_d7

__all__ = [
    "AuditAccumulator",
    "BoxLSQResult",
    "Q_FLOOR",
    "RatioAccumulator",
    "RatioStats",
    "RetentionAccumulator",
    "THEOREM_COLUMNS",
    "comparator_gap_diag",
    "comparator_gap_masked",
    "normal_equations",
    "solve_box_lsq",
    "theorem_d7",
]
