"""Streaming statistics of residual ratios.

Every reported statistic is built from sufficient statistics — ``n``, ``Σ log q`` and ``Σ q`` — kept
per (layer, head, task), so a table larger than memory can be summarised one call at a time and
partial results (e.g. from several processes) combine exactly by addition, never by averaging
averages.

``q_geo = exp(Σ log max(q, q_floor) / n)`` with ``q_floor = 1e-30`` (an exact zero ratio, e.g. an
exact Newton write, would otherwise send the geometric mean to 0; the number of such tokens is
reported as ``n_zero``). ``q_arith = Σ q / n``. Rows flagged non-finite are never counted.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch

__all__ = ["Q_FLOOR", "RatioStats", "RatioAccumulator"]

Q_FLOOR = 1e-30


class RatioStats:
    """Sufficient statistics of a set of ratios."""

    __slots__ = ("n", "n_zero", "sum_log", "sum")

    def __init__(self, n: int = 0, n_zero: int = 0, sum_log: float = 0.0, sum: float = 0.0):
        self.n, self.n_zero, self.sum_log, self.sum = n, n_zero, sum_log, sum

    @classmethod
    def of(cls, q: torch.Tensor) -> RatioStats:
        q = q.to(torch.float64)
        return cls(
            n=int(q.numel()),
            n_zero=int((q == 0).sum()),
            sum_log=float(q.clamp_min(Q_FLOOR).log().sum()),
            sum=float(q.sum()),
        )

    def __iadd__(self, other: RatioStats) -> RatioStats:
        self.n += other.n
        self.n_zero += other.n_zero
        self.sum_log += other.sum_log
        self.sum += other.sum
        return self

    @property
    def q_geo(self) -> float:
        return math.exp(self.sum_log / self.n) if self.n else float("nan")

    @property
    def q_arith(self) -> float:
        return self.sum / self.n if self.n else float("nan")

    def as_dict(self) -> dict:
        return {"q_geo": self.q_geo, "q_arith": self.q_arith, "n": self.n, "n_zero": self.n_zero}


def _total(items: Iterable[RatioStats]) -> RatioStats:
    out = RatioStats()
    for s in items:
        out += s
    return out


class RatioAccumulator:
    """Accumulates ratio statistics per (layer, head, task) from replayed calls.

    Args:
        column: which ratio to summarise (``residual_ratio``, or ``residual_ratio_post`` for the
            post-decay ratio of gated backbones).
    """

    def __init__(self, column: str = "residual_ratio"):
        self.column = column
        self.cells: dict[tuple[int, int, str], RatioStats] = defaultdict(RatioStats)
        self.excluded_nonfinite = 0

    def add(self, layer: int, columns: Mapping[str, torch.Tensor], tasks: list[str]) -> None:
        """Add one replayed call. ``columns`` must hold ``sequence``, ``head``, ``finite`` and the
        ratio column; ``tasks[i]`` is the task of the call's i-th sequence."""
        if self.column not in columns:
            return
        q = columns[self.column]
        finite = columns["finite"]
        self.excluded_nonfinite += int((~finite).sum())
        seq, head = columns["sequence"], columns["head"]
        for s in torch.unique(seq).tolist():
            for h in torch.unique(head).tolist():
                sel = (seq == s) & (head == h) & finite
                if bool(sel.any()):
                    self.cells[(layer, h, tasks[s])] += RatioStats.of(q[sel])

    def merge(self, other: RatioAccumulator) -> None:
        for key, stats in other.cells.items():
            self.cells[key] += stats
        self.excluded_nonfinite += other.excluded_nonfinite

    def _by(self, key_of) -> dict:
        groups: dict = defaultdict(RatioStats)
        for key, stats in self.cells.items():
            groups[key_of(*key)] += stats
        return {k: groups[k].as_dict() for k in sorted(groups)}

    def summary(self) -> dict:
        total = _total(self.cells.values())
        return {
            **total.as_dict(),
            "by_layer": self._by(lambda layer, head, task: f"{layer:03d}"),
            "by_head": self._by(lambda layer, head, task: f"{layer:03d}.{head:03d}"),
            "by_task": self._by(lambda layer, head, task: task),
            "excluded_nonfinite": self.excluded_nonfinite,
        }
