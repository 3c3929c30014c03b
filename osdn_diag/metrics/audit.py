"""Assumption audit: which of the theory's hypotheses a captured layer satisfies, per head.

Theorem D.7 (and Corollary A.2) assume unit keys, ``β_t ∈ (0, 1)``, ``d_t`` inside the box
``[d_min, d_max]^K``, no state decay, and they say nothing about tokens whose residual is zero.

**Whether the hypotheses hold** is decided per (prompt, layer, head) stream, by the one definition of
:mod:`osdn_diag.metrics.hypotheses` over the stream's valid tokens — the same streams, tokens and
checks as ``comparator.parquet``'s ``hypotheses_hold``. The audit counts them: ``streams``,
``hypotheses_hold`` (streams on which every check passes) and ``hypotheses_failed`` (per check, the
streams failing it), overall, per layer and per head.

Beside the counts, every (layer, head) records over its finite tokens:

* ``max_unit_dev`` — ``max |‖k_t‖² − 1|`` over the keys exactly as the kernel read them: for fla's
  chunk paths of a bf16 model these are bf16-rounded unit vectors, whose ``‖k‖²`` can sit ~4e-3 from 1
  — near β = 1 that, not the model, sets ``q_t = (1 − β‖k‖²)²``;
* ``keys_read_as`` and ``key_rounding_bound`` — the dtype(s) the kernel read its keys in and the
  largest ``|‖k‖² − 1|`` that rounding a unit key to that dtype can cause, ``(1 + u)² − 1`` for the
  dtype's unit roundoff ``u`` (7.8e-3 for bf16, 1.2e-7 for fp32), and ``key_norm_tol``, the
  tolerance the check ``unit_keys`` applies (``unit_tol`` plus that bound);
* ``beta_min``, ``beta_max``;
* ``d_min``, ``d_max`` of the write preconditioner (1 when the layer has none);
* ``share_zero_residual`` — tokens with ``f_t(S_{t−1}) = 0`` (the ratio is then 1 by convention);
* ``share_newton_infeasible`` — tokens with ``β_t < 1/d_max``: under unit keys
  ``β_t⟨d, s_t⟩ ≤ β_t d_max < 1``, so the gated Newton condition cannot hold there;
* ``decay`` — whether the layer decays its state (gated backbones are outside the theorem).

The numbers are kept as running extrema and counts, so they combine across calls and processes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..capture.record import KernelCall
from ..runtime.host import to_device
from . import hypotheses

__all__ = ["AuditAccumulator", "HeadAudit"]


@dataclass
class HeadAudit:
    n: int = 0
    max_unit_dev: float = 0.0
    beta_min: float = float("inf")
    beta_max: float = float("-inf")
    d_min: float = float("inf")
    d_max: float = float("-inf")
    n_zero_residual: int = 0
    n_newton_infeasible: int = 0
    decay: bool = False
    key_rounding_bound: float = 0.0
    keys_read_as: frozenset = frozenset()
    streams: int = 0
    hypotheses_hold: int = 0
    hypotheses_failed: dict = field(default_factory=dict)  # check -> streams failing it

    def merge(self, o: HeadAudit) -> None:
        self.n += o.n
        self.max_unit_dev = max(self.max_unit_dev, o.max_unit_dev)
        self.beta_min, self.beta_max = min(self.beta_min, o.beta_min), max(self.beta_max, o.beta_max)
        self.d_min, self.d_max = min(self.d_min, o.d_min), max(self.d_max, o.d_max)
        self.n_zero_residual += o.n_zero_residual
        self.n_newton_infeasible += o.n_newton_infeasible
        self.decay = self.decay or o.decay
        self.key_rounding_bound = max(self.key_rounding_bound, o.key_rounding_bound)
        self.keys_read_as = self.keys_read_as | o.keys_read_as
        self.streams += o.streams
        self.hypotheses_hold += o.hypotheses_hold
        for name, n in o.hypotheses_failed.items():
            self.hypotheses_failed[name] = self.hypotheses_failed.get(name, 0) + n

    def as_dict(self, unit_tol: float) -> dict:
        return {
            "streams": self.streams,
            "hypotheses_hold": self.hypotheses_hold,
            "hypotheses_failed": {name: self.hypotheses_failed.get(name, 0) for name in hypotheses.HYPOTHESES},
            "n": self.n,
            "max_unit_dev": self.max_unit_dev,
            "keys_read_as": sorted(self.keys_read_as),
            "key_rounding_bound": self.key_rounding_bound,
            "key_norm_tol": unit_tol + self.key_rounding_bound,
            "beta_min": self.beta_min,
            "beta_max": self.beta_max,
            "d_min": self.d_min,
            "d_max": self.d_max,
            "share_zero_residual": self.n_zero_residual / self.n if self.n else 0.0,
            "share_newton_infeasible": self.n_newton_infeasible / self.n if self.n else 0.0,
            "decay": self.decay,
        }


class AuditAccumulator:
    """Per (layer, head) audit over replayed calls.

    Args:
        box: the preconditioner box ``(d_min, d_max)`` the theorem is checked against.
        unit_tol: largest ``|‖k‖² − 1|`` counted as a unit key before the rounding of the dtype the
            keys were read in is added (:func:`~osdn_diag.metrics.hypotheses.key_norm_tol`).
    """

    def __init__(self, box: tuple[float, float] = (0.5, 2.0), unit_tol: float = hypotheses.KEY_NORM_BASE_TOL):
        self.box = box
        self.unit_tol = unit_tol
        self.heads: dict[tuple[int, int], HeadAudit] = {}

    def add(self, call: KernelCall, loss_before: torch.Tensor, finite: torch.Tensor,
            valid: torch.Tensor | None = None, *, segments: list[tuple[int, int, int]] | None = None) -> None:
        """``loss_before``, ``finite`` and ``valid`` are ``[B, T, H]``: the replay's ``loss_before``, its
        finiteness, and Theorem D.7's valid tokens (the replay's ``theorem_valid``; by default the
        finite tokens with a non-zero residual), over which each stream's hypotheses are checked.
        ``segments`` are ``call.segments()`` where the caller has them already (with ``cu_seqlens`` on
        a GPU, reading them again would wait for it)."""
        if valid is None:
            valid = finite & (loss_before != 0)
        k2 = call.k.double().square().sum(-1)
        beta = call.beta.double()
        ok = finite
        inf = float("inf")
        tok = (0, 1)  # reduce over batch and time, per head
        stats = [
            ok.sum(tok).double(),
            torch.where(ok, (k2 - 1).abs(), -inf).amax(tok),
            torch.where(ok, beta, inf).amin(tok),
            torch.where(ok, beta, -inf).amax(tok),
            (ok & (loss_before == 0)).sum(tok).double(),
            (ok & (beta < 1.0 / self.box[1])).sum(tok).double(),
        ]
        if call.d is not None:
            d = call.d.double()
            stats += [torch.where(ok[..., None], d, inf).amin((0, 1, 3)),
                      torch.where(ok[..., None], d, -inf).amax((0, 1, 3))]
        read_as = str(call.flags.get("qk_read_as", "float32"))
        rounding = hypotheses.key_rounding_bound(read_as)
        flags = self._stream_checks(call, k2, beta, valid, self.unit_tol + rounding, segments)
        # One transfer for every head's numbers and every stream's checks (reading them one by one, or
        # in two parts, would synchronise each time); the checks' booleans travel as 0.0 / 1.0. On the
        # host they are counted with numpy: per head and check, a torch operation each would cost some
        # 200 dispatches a call for eight heads.
        per_head = torch.stack([flags[name] for name in (*hypotheses.HYPOTHESES, "hypotheses_hold")], -1)
        stacked = torch.stack(stats)  # [statistics, H]
        host = torch.cat([stacked.reshape(-1), per_head.double().reshape(-1)]).cpu().numpy()
        rows = host[:stacked.numel()].reshape(stacked.shape).T.tolist()
        checks = host[stacked.numel():].reshape(-1, call.num_heads, per_head.shape[-1]) != 0  # [S, H, checks + 1]
        holding = checks[:, :, -1].sum(0).tolist()  # [H]: streams on which every check passes
        failing = (~checks[:, :, :-1]).sum(0).tolist()  # [H, checks]: streams failing each check
        for h, row in enumerate(rows):
            n, dev, b_lo, b_hi, n_zero, n_newton = row[:6]
            counted = HeadAudit(
                streams=checks.shape[0],
                hypotheses_hold=int(holding[h]),
                hypotheses_failed={name: int(failing[h][i]) for i, name in enumerate(hypotheses.HYPOTHESES)},
                key_rounding_bound=rounding,
                keys_read_as=frozenset({read_as}),
            )
            self.heads.setdefault((call.layer, h), HeadAudit()).merge(counted)
            if not n:
                continue
            audit = HeadAudit(
                n=int(n),
                max_unit_dev=dev,
                beta_min=b_lo,
                beta_max=b_hi,
                d_min=row[6] if call.d is not None else 1.0,
                d_max=row[7] if call.d is not None else 1.0,
                n_zero_residual=int(n_zero),
                n_newton_infeasible=int(n_newton),
                decay=call.g is not None,
            )
            self.heads.setdefault((call.layer, h), HeadAudit()).merge(audit)

    def _stream_checks(self, call: KernelCall, k2, beta, valid, tol: float,
                       segments: list[tuple[int, int, int]] | None = None) -> dict[str, torch.Tensor]:
        """The hypotheses' checks for the call's streams, ``[S·H]`` (stream ``i·H + h`` is head ``h``
        of the call's ``i``-th sequence, as in ``comparator.parquet``), over the ``valid`` tokens
        (``[B, T, H]``); ``segments`` are ``call.segments()``, when the caller has them."""
        segs = call.segments() if segments is None else segments
        B, T, H = beta.shape
        dev = beta.device
        P = len(segs) * H
        extremes = 4 if call.d is not None else 3
        inside, idx, idx_wide = _stream_index(tuple(map(tuple, segs)), B, T, H, extremes, dev)
        m = (valid.bool() & inside).reshape(-1)  # [B·T·H]
        n_valid = torch.zeros(P, dtype=torch.long, device=dev).index_add_(0, idx, m.long())

        # Every token is scattered, the ones left out as the reduction's identity (-inf): selecting the
        # valid ones (``x[m]``) would make the host wait for the GPU to learn how many there are. The
        # stream extremes are one scattered maximum over a column each (a maximum is exact in any
        # order): max |‖k‖² − 1|, max β, max −β (= −min β) and, with d, max of "some d_t outside the box".
        cols = [(k2 - 1).abs(), beta, -beta]
        if call.d is not None:
            lo, hi = self.box
            cols.append(~((call.d >= lo) & (call.d <= hi)).all(-1))  # [B, T, H]
        x = torch.stack(cols, -1).reshape(-1, extremes).double()  # [B·T·H, extremes]
        x = torch.where(m[:, None], x, float("-inf"))
        out = torch.full((P, extremes), float("-inf"), dtype=torch.float64, device=dev)
        most = out.scatter_reduce(0, idx_wide, x, "amax", include_self=True).unbind(1)
        dev_max, b_hi, b_lo = most[0], most[1], -most[2]
        # No d: every d_t is 1, inside the box. A stream without valid tokens has −inf here; its check
        # is vacuous (hypotheses.check reads it only where n_valid > 0).
        d_ok = torch.ones(P, dtype=torch.bool, device=dev) if call.d is None else most[3] <= 0
        return hypotheses.check(n_valid, dev_max, b_lo, b_hi, d_ok, call.g is not None, tol)

    def merge(self, other: AuditAccumulator) -> None:
        for key, audit in other.heads.items():
            self.heads.setdefault(key, HeadAudit()).merge(audit)

    def summary(self) -> dict:
        by_layer: dict[int, HeadAudit] = {}
        for (layer, _), a in self.heads.items():
            by_layer.setdefault(layer, HeadAudit()).merge(a)
        total = HeadAudit()
        for a in by_layer.values():
            total.merge(a)
        fmt = lambda a: a.as_dict(self.unit_tol)  # noqa: E731
        return {
            "box": list(self.box),
            "unit_tol": self.unit_tol,
            **fmt(total),
            "by_layer": {f"{k:03d}": fmt(a) for k, a in sorted(by_layer.items())},
            "by_head": {f"{k[0]:03d}.{k[1]:03d}": fmt(a) for k, a in sorted(self.heads.items())},
        }


@functools.lru_cache(maxsize=8)
def _stream_index(segments: tuple, B: int, T: int, H: int, columns: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each token of a ``[B, T, H]`` grid with these segments belongs among the call's ``S·H``
    streams: ``inside [B, T, 1]`` (False on packed padding), ``idx [B·T·H]`` (the token's stream, 0 on
    padding) and ``idx`` expanded to ``[B·T·H, columns]``.

    Every layer of a forward batch has the same segments: built once and kept (an LRU of eight),
    which saves some thirty small operations per call. The tensors are shared between calls and
    must not be modified in place."""
    # seq[b, t]: the sequence token (b, t) belongs to, or -1 (packed padding).
    seq = torch.full((B, T), -1, dtype=torch.long)
    for i, (row, start, end) in enumerate(segments):
        seq[row, start:end] = i
    seq = to_device(seq, device)
    idx = (seq.clamp_min(0)[..., None] * H + torch.arange(H, device=device)).reshape(-1)
    return (seq >= 0)[..., None], idx, idx[:, None].expand(-1, columns)
