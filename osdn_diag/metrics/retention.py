"""Retained associations: how well the state still retrieves what was written earlier.

The residual ratio measures each write against its *own* token; a write that drives ``f_t`` to zero
can still overwrite associations the model needs later (the ±1 counterexample of App. D.4 is the
extreme case). This measures the other side: at a probe position ``t`` (the end of the first copy of
a repeated context, and the last token — where the query is read), for every earlier write ``j ≤ t``

    retrieval_error(t, j) = ‖S_t k_j − v_j‖² / ‖v_j‖²

(0: the association is intact; 1: as if never written; > 1: damaged). States are recomputed in fp32
by the reference recurrence, as in replay. Rows with ``‖v_j‖ = 0`` are skipped, and so are the heads
whose inputs in the sequence are not all finite (the streams the replay leaves out).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from ..capture.record import KernelCall
from ..math.recurrence import delta_rule_recurrence

__all__ = ["RetentionAccumulator", "probe_positions", "retrieval_errors"]


def probe_positions(length: int, repeat_start: int) -> list[int]:
    """The end of the first copy (when the context repeats) and the last token."""
    probes = [length - 1]
    if 0 < repeat_start < length:
        probes.insert(0, repeat_start - 1)
    return probes


def retrieval_errors(call: KernelCall, seq: int, probes: list[int]) -> dict[str, torch.Tensor]:
    """Retrieval errors of every earlier write ``j ≤ t`` at each probe ``t`` of sequence ``seq``.

    Returns flat, equally long columns ``probe, head, j, distance, error`` (positions counted within
    the sequence)."""
    row, start, end = call.segments()[seq]
    sl = slice(start, end)
    q, k, v, beta = (x[row : row + 1, sl].float() for x in (call.q, call.k, call.v, call.beta))
    g = None if call.g is None else call.g[row : row + 1, sl].float()
    wk = None if call.d is None else call.d[row : row + 1, sl].float() * k
    h0 = None
    if call.initial_state is not None:
        h0 = call.initial_state[seq : seq + 1].float()
    H = k.shape[2]
    # A head whose inputs in this sequence are not all finite is a stream the replay leaves out
    # (``nonfinite``): it is left out here too, its recurrence run on zeros.
    finite = torch.ones(H, dtype=torch.bool, device=k.device)
    for x in (q, k, v, beta, g, wk):
        if x is not None:
            finite &= torch.isfinite(x).reshape(x.shape[1], H, -1).all(-1).all(0)
    if h0 is not None:
        finite &= torch.isfinite(h0).flatten(2).all(-1)[0]
    if not bool(finite.all()):
        bad = ~finite
        q, k, v, beta, g, wk = (None if x is None else torch.where(
            bad.reshape(1, 1, H, *([1] * (x.dim() - 3))), 0.0, x) for x in (q, k, v, beta, g, wk))
        h0 = None if h0 is None else torch.where(bad.reshape(1, H, 1, 1), 0.0, h0)
    cols: dict[str, list[torch.Tensor]] = defaultdict(list)
    # A record of several writes per token (GatedDeltaProduct: ``micro_steps``, interleaved) is
    # probed after the probe token's last write; every micro-step write is an association, and
    # ``j`` and the distance count tokens.
    micro = int(call.flags.get("micro_steps", 1))
    for t in probes:
        tm = (t + 1) * micro - 1  # the row of the probe token's last write
        res = delta_rule_recurrence(
            q[:, : tm + 1], k[:, : tm + 1], v[:, : tm + 1], beta[:, : tm + 1],
            write_key=None if wk is None else wk[:, : tm + 1],
            g=None if g is None else g[:, : tm + 1],
            initial_state=h0, scale=call.scale, dtype=torch.float32,
        )
        S = res.final_state[0]  # [H, V, K]
        kj, vj = k[0, : tm + 1].transpose(0, 1), v[0, : tm + 1].transpose(0, 1)  # [H, tm+1, ·]
        err = (torch.einsum("hvk,hjk->hjv", S, kj) - vj).square().sum(-1)
        norm = vj.square().sum(-1)
        # The columns are built on the CPU, where the accumulator sums them, whatever the call's device.
        ok, rel = ((norm > 0) & finite[:, None]).cpu(), (err / norm.clamp_min(1e-30)).cpu()
        j = (torch.arange(tm + 1) // micro).expand(H, -1)
        cols["probe"].append(torch.full((int(ok.sum()),), t))
        cols["head"].append(torch.arange(H)[:, None].expand(H, tm + 1)[ok])
        cols["j"].append(j[ok])
        cols["distance"].append((t - j)[ok])
        cols["error"].append(rel[ok])
    return {name: torch.cat(parts) for name, parts in cols.items()}


def _cell() -> list:
    return [0.0, 0]


class RetentionAccumulator:
    """Mean retrieval error by distance ``t − j`` (bins ``[0, 1), [1, 2), [2, 4), …``) and at the
    last token, per task; sufficient statistics only (sums and counts)."""

    def __init__(self):
        self.by_distance: dict[tuple[str, int], list[float]] = defaultdict(_cell)
        self.at_last: dict[str, list[float]] = defaultdict(_cell)
        self.first_copy_at_last: dict[str, list[float]] = defaultdict(_cell)

    @staticmethod
    def distance_bin(d: torch.Tensor) -> torch.Tensor:
        return torch.where(d < 1, torch.zeros_like(d), torch.floor(torch.log2(d.clamp_min(1).double())).long() + 1)

    def add(self, task: str, cols: dict[str, torch.Tensor], length: int, repeat_start: int) -> None:
        err, dist = cols["error"].double(), cols["distance"]
        bins = self.distance_bin(dist)
        for b in torch.unique(bins).tolist():
            sel = bins == b
            cell = self.by_distance[(task, b)]
            cell[0] += float(err[sel].sum())
            cell[1] += int(sel.sum())
        last = cols["probe"] == length - 1
        self.at_last[task][0] += float(err[last].sum())
        self.at_last[task][1] += int(last.sum())
        if repeat_start > 0:
            first = last & (cols["j"] < repeat_start)
            self.first_copy_at_last[task][0] += float(err[first].sum())
            self.first_copy_at_last[task][1] += int(first.sum())

    def merge(self, other: RetentionAccumulator) -> None:
        for mine, theirs in ((self.by_distance, other.by_distance), (self.at_last, other.at_last),
                             (self.first_copy_at_last, other.first_copy_at_last)):
            for key, (total, n) in theirs.items():
                mine[key][0] += total
                mine[key][1] += n

    def summary(self) -> dict:
        mean = lambda c: c[0] / c[1] if c[1] else math.nan  # noqa: E731
        tasks = sorted({t for t, _ in self.by_distance})
        out = {}
        for task in tasks:
            bins = sorted(b for t, b in self.by_distance if t == task)
            out[task] = {
                "distance_bins": [[0, 1] if b == 0 else [2 ** (b - 1), 2**b] for b in bins],
                "mean_error": [mean(self.by_distance[(task, b)]) for b in bins],
                "n": [self.by_distance[(task, b)][1] for b in bins],
                "mean_error_at_last_token": mean(self.at_last[task]),
                "mean_error_of_first_copy_at_last_token": mean(self.first_copy_at_last[task]),
            }
        return out
