"""Streaming statistics of residual ratios.

Every reported statistic is built from sufficient statistics — ``n``, ``Σ log q`` and ``Σ q`` — kept
per (layer, head, task, relative-position bin), so a table larger than memory can be summarised one
call at a time, and partial results (e.g. from several processes) combine exactly by addition, never
by averaging averages.

``q_geo = exp(Σ log max(q, q_floor) / n)`` with ``q_floor = 1e-30`` (an exact zero ratio, e.g. an
exact Newton write, would otherwise send the geometric mean to 0; the number of such tokens is
reported as ``n_zero``). ``q_arith = Σ q / n``. Rows flagged non-finite are never counted.
Relative position is ``pos / length`` of the token's sequence, binned into ``num_bins`` equal bins of
``[0, 1)``.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable, Mapping

import numpy as np
import torch

from ..runtime.host import from_host

__all__ = ["Q_FLOOR", "RatioAccumulator", "RatioStats"]

Q_FLOOR = 1e-30


class RatioStats:
    """Sufficient statistics of a set of ratios."""

    __slots__ = ("n", "n_zero", "sum", "sum_log")

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


Key = tuple[int, int, str, int]  # (layer, head, task, position bin)


def _cell_lengths(code: torch.Tensor, size: int, dev) -> torch.Tensor:
    """``[size]``: how many rows of each cell ``0..size−1`` there are, where ``code`` ``[N]`` (non-decreasing)
    names each row's cell. Where ``code`` is out of order the lengths are meaningless but stay inside the
    rows (the bounds are made non-decreasing), so that a caller may sum first and check the order after."""
    bounds = torch.cummax(torch.searchsorted(code, torch.arange(size + 1, device=dev)), 0).values
    return bounds.diff()


def _cell_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[size, 5]``: the sums of ``values`` ``[N, 5]`` over consecutive runs of ``lengths`` ``[size]``
    rows (one segmented sum per cell; the lengths from :func:`_cell_lengths`)."""
    return torch.segment_reduce(values, "sum", lengths=lengths, axis=0, unsafe=True)


#: Row layouts already seen (:meth:`RatioAccumulator.add`'s ``layout``): key → ``(order, lengths)``, the
#: stable sort of the rows by cell (``None`` where they come in cell order) and the rows per cell. At
#: most eight, the most recently used kept. Device tensors: kept here, never in an accumulator (which
#: is pickled between ranks).
_LAYOUTS: OrderedDict = OrderedDict()
_LAYOUTS_KEPT = 8


class RatioAccumulator:
    """Accumulates ratio statistics per (layer, head, task, relative-position bin).

    Args:
        column: which ratio to summarise (``residual_ratio``, or ``residual_ratio_post`` for the
            post-decay ratio of gated backbones).
        num_bins: relative-position bins over ``[0, 1)``.
    """

    def __init__(self, column: str = "residual_ratio", num_bins: int = 10):
        if num_bins < 1:
            raise ValueError(f"argument 'num_bins': expected >= 1, got {num_bins}")
        self.column = column
        self.num_bins = num_bins
        self.cells: dict[Key, RatioStats] = defaultdict(RatioStats)
        self.excluded_nonfinite = 0

    def add(
        self,
        layer: int,
        columns: Mapping[str, torch.Tensor],
        tasks: list[str],
        lengths: list[int],
        num_heads: int | None = None,
        *,
        layout: Hashable | None = None,
    ) -> None:
        """Add one replayed call. ``columns`` holds ``sequence``, ``head``, ``pos``, ``finite`` and the
        ratio column (1-D, one entry per token, on any one device); ``tasks[i]`` and ``lengths[i]``
        describe the call's i-th sequence; ``num_heads`` defaults to the largest head + 1.

        The sums are taken where the columns are (on a GPU: one transfer of the per-cell sums, no
        other wait) and are deterministic: a stable sort by cell and one segmented sum per cell,
        where scattered atomic adds would add in a different order on every run (rows that come in cell
        order, as a replay's do, are not sorted again). The call's sequences of one task share their
        cells: their sums are added together on the host (numpy) before the cells are, so that the
        Python loop runs over (task, head, bin), not (sequence, head, bin): 80 entries instead of 640
        for a batch of eight sequences of one task, ten bins and eight heads.

        ``layout`` (any hashable key) names the rows' layout: calls given equal keys must have equal
        ``sequence``, ``head`` and ``pos`` columns (and ``lengths`` and ``num_heads``). Each row's cell,
        the rows per cell and whether the rows come in cell order depend only on that, and are then
        found once per layout (an LRU of eight) instead of once per call: every layer of a forward batch
        has the same one (the replay passes its segments, heads and micro-steps)."""
        if self.column not in columns:
            return
        finite = columns["finite"].bool()
        dev = finite.device
        q = torch.where(finite, columns[self.column].to(torch.float64), 1.0)
        if num_heads is None:
            head = columns["head"].long()
            num_heads = int(head.max()) + 1 if head.numel() else 1
        size = len(lengths) * num_heads * self.num_bins
        w = finite.to(torch.float64)
        # [N, 5]: n, n_zero, Σ log q, Σ q, excluded. A non-finite row has q = 1 here, so its (q == 0) and
        # log q are 0 already (the same values as w·(q == 0) and w·log q, two operations fewer).
        values = torch.stack([w, q == 0, q.clamp_min(Q_FLOOR).log(), w * q, 1.0 - w], dim=1)
        key = None if layout is None else (layout, tuple(lengths), num_heads, self.num_bins, dev)
        known = None if key is None else _LAYOUTS.get(key)
        if known is not None:  # the cells of this layout's rows, found on an earlier call
            _LAYOUTS.move_to_end(key)
            order, cell_lengths = known
            if order is not None:
                values = values[order]
            host = _cell_sums(values, cell_lengths).cpu().numpy()
        else:
            code = self._codes(columns, lengths, num_heads)
            # A replay's rows come in cell order already: summed as they come, with a flag that says
            # whether they did, read in the same transfer as the sums (asking first would wait for the
            # GPU once more); rows out of order are sorted and summed again, on the host's word.
            ordered = (code[1:] >= code[:-1]).all().double().reshape(1)
            cell_lengths = _cell_lengths(code, size, dev)
            sums = _cell_sums(values, cell_lengths)
            host = torch.cat([sums.reshape(-1), ordered]).cpu().numpy()  # the one transfer
            order = None
            if not host[-1]:
                code, order = torch.sort(code, stable=True)
                cell_lengths = _cell_lengths(code, size, dev)
                host = _cell_sums(values[order], cell_lengths).cpu().numpy()
            if key is not None:
                _LAYOUTS[key] = (order, cell_lengths)
                while len(_LAYOUTS) > _LAYOUTS_KEPT:
                    _LAYOUTS.popitem(last=False)
        sums = host[:size * 5].reshape(len(lengths), num_heads * self.num_bins, 5)
        for task in sorted(set(tasks)):
            part = sums[[i for i, t in enumerate(tasks) if t == task]].sum(0)  # [heads · bins, 5]
            for c in np.flatnonzero(part[:, 0]):
                h, b = divmod(int(c), self.num_bins)
                n, n_zero, s_log, s, _ = part[c].tolist()
                self.cells[(layer, h, task, b)] += RatioStats(int(n), int(n_zero), s_log, s)
        self.excluded_nonfinite += int(sums[..., 4].sum())

    def _codes(self, columns: Mapping[str, torch.Tensor], lengths: list[int], num_heads: int) -> torch.Tensor:
        """``[N]``: each row's cell among the call's ``(sequence, head, position bin)``, numbered
        ``(sequence · num_heads + head) · num_bins + bin``."""
        seq = columns["sequence"].long()
        head = columns["head"].long()
        length = from_host(lengths, torch.float64, seq.device)[seq]
        rel = columns["pos"].to(torch.float64) / length
        bins = (rel * self.num_bins).floor().long().clamp_(0, self.num_bins - 1)
        return (seq * num_heads + head) * self.num_bins + bins

    def merge(self, other: RatioAccumulator) -> None:
        for key, stats in other.cells.items():
            self.cells[key] += stats
        self.excluded_nonfinite += other.excluded_nonfinite

    def _by(self, key_of: Callable[..., object]) -> dict:
        groups: dict = defaultdict(RatioStats)
        for key, stats in self.cells.items():
            groups[key_of(*key)] += stats
        return {k: groups[k].as_dict() for k in sorted(groups)}

    def per_token(self, families: Mapping[int, str]) -> dict:
        """The overall and per-family statistics only (``{"all": ..., "by_family": {...}}``): what
        the summary adds for the per-token ratio (``token_ratio``, see :class:`RatioAccumulator`)."""
        total = RatioStats()
        for stats in self.cells.values():
            total += stats
        return {"all": total.as_dict(),
                "by_family": self._by(lambda layer, head, task, b: families.get(layer, "unknown"))}

    def _bins(self, select: Callable[..., bool]) -> dict:
        totals = [RatioStats() for _ in range(self.num_bins)]
        for key, stats in self.cells.items():
            if select(*key):
                totals[key[3]] += stats
        return {
            "q_geo": [t.q_geo for t in totals],
            "q_arith": [t.q_arith for t in totals],
            "n": [t.n for t in totals],
        }

    def summary(
        self,
        repeat_boundary: Mapping[str, float] | None = None,
        families: Mapping[int, str] | None = None,
    ) -> dict:
        """The summary dictionary; ``repeat_boundary`` (task → mean relative position where the
        repeated context starts) is recorded with the position bins; ``families`` (layer → kernel
        family, e.g. ``"gated_delta_rule"``) adds ``by_family``, the statistics of each family's layers
        together (a hybrid or several-family model has more than one)."""
        total = RatioStats()
        for stats in self.cells.values():
            total += stats
        tasks = sorted({key[2] for key in self.cells})
        edges = [i / self.num_bins for i in range(self.num_bins + 1)]
        return {
            **total.as_dict(),
            "by_layer": self._by(lambda layer, head, task, b: f"{layer:03d}"),
            "by_head": self._by(lambda layer, head, task, b: f"{layer:03d}.{head:03d}"),
            "by_task": self._by(lambda layer, head, task, b: task),
            **({} if families is None else
               {"by_family": self._by(lambda layer, head, task, b: families.get(layer, "unknown"))}),
            "position_bins": {
                "edges": edges,
                **self._bins(lambda *key: True),
                "by_task": {t: self._bins(lambda layer, head, task, b, t=t: task == t) for t in tasks},
                "repeat_boundary": dict(repeat_boundary or {}),
            },
            "excluded_nonfinite": self.excluded_nonfinite,
        }
