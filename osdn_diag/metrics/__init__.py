"""Statistics over replayed residual ratios."""

from .ratios import Q_FLOOR, RatioAccumulator, RatioStats

__all__ = ["Q_FLOOR", "RatioAccumulator", "RatioStats"]
