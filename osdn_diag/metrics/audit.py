"""Assumption audit: which of the theory's hypotheses a captured layer satisfies, per head.

Theorem D.7 (and Corollary A.2) assume unit keys, ``β_t ∈ (0, 1)``, ``d_t`` inside the box
``[d_min, d_max]^K``, no state decay, and they say nothing about tokens whose residual is zero. For
every (layer, head) the audit records, over the finite tokens:

* ``max_unit_dev`` — ``max |‖k_t‖² − 1|`` over the keys exactly as the kernel read them: for fla's
  chunk paths of a bf16 model these are bf16-rounded unit vectors, whose ``‖k‖²`` can sit ~4e-3 from 1
  — near β = 1 that, not the model, sets ``q_t = (1 − β‖k‖²)²``;
* ``keys_read_as`` and ``key_rounding_bound`` — the dtype(s) the kernel read its keys in and the
  largest ``|‖k‖² − 1|`` that rounding a unit key to that dtype can cause, ``(1 + u)² − 1`` for the
  dtype's unit roundoff ``u`` (7.8e-3 for bf16, 1.2e-7 for fp32); ``unit_keys`` allows that much on
  top of ``unit_tol`` (``unit_keys_exact`` does not);
* ``beta_min``, ``beta_max``;
* ``d_min``, ``d_max`` of the write preconditioner (1 when the layer has none) and whether it stays
  inside the box;
* ``share_zero_residual`` — tokens with ``f_t(S_{t−1}) = 0`` (the ratio is then 1 by convention);
* ``share_newton_infeasible`` — tokens with ``β_t < 1/d_max``: under unit keys
  ``β_t⟨d, s_t⟩ ≤ β_t d_max < 1``, so the gated Newton condition cannot hold there;
* ``decay`` — whether the layer decays its state (gated backbones are outside the theorem).

The numbers are kept as running extrema and counts, so they combine across calls and processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..capture.kernel_inputs import unit_roundoff
from ..capture.record import KernelCall

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

    def as_dict(self, box: tuple[float, float], unit_tol: float) -> dict:
        lo, hi = box
        exact = self.max_unit_dev <= unit_tol
        unit = self.max_unit_dev <= unit_tol + self.key_rounding_bound
        beta_ok = 0 < self.beta_min and self.beta_max < 1
        d_ok = lo <= self.d_min and self.d_max <= hi
        return {
            "n": self.n,
            "max_unit_dev": self.max_unit_dev,
            "unit_keys": unit,
            "unit_keys_exact": exact,
            "keys_read_as": sorted(self.keys_read_as),
            "key_rounding_bound": self.key_rounding_bound,
            "beta_min": self.beta_min,
            "beta_max": self.beta_max,
            "beta_in_open_unit_interval": beta_ok,
            "d_min": self.d_min,
            "d_max": self.d_max,
            "d_in_box": d_ok,
            "share_zero_residual": self.n_zero_residual / self.n if self.n else 0.0,
            "share_newton_infeasible": self.n_newton_infeasible / self.n if self.n else 0.0,
            "decay": self.decay,
            "theorem_d7_hypotheses_hold": unit and beta_ok and d_ok and not self.decay,
        }


class AuditAccumulator:
    """Per (layer, head) audit over replayed calls.

    Args:
        box: the preconditioner box ``(d_min, d_max)`` the theorem is checked against.
        unit_tol: largest ``|‖k‖² − 1|`` still counted as a unit key.
    """

    def __init__(self, box: tuple[float, float] = (0.5, 2.0), unit_tol: float = 1e-3):
        self.box = box
        self.unit_tol = unit_tol
        self.heads: dict[tuple[int, int], HeadAudit] = {}

    def add(self, call: KernelCall, loss_before: torch.Tensor, finite: torch.Tensor) -> None:
        """``loss_before`` and ``finite`` are ``[B, T, H]`` (replay's ``loss_before``, finiteness)."""
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
        rounding = (1.0 + unit_roundoff(read_as)) ** 2 - 1.0
        # One transfer for every head's numbers (reading them one by one would synchronise each time).
        rows = torch.stack(stats).cpu().T.tolist()
        for h, row in enumerate(rows):
            n, dev, b_lo, b_hi, n_zero, n_newton = row[:6]
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
                key_rounding_bound=rounding,
                keys_read_as=frozenset({read_as}),
            )
            self.heads.setdefault((call.layer, h), HeadAudit()).merge(audit)

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
        fmt = lambda a: a.as_dict(self.box, self.unit_tol)  # noqa: E731
        return {
            "box": list(self.box),
            "unit_tol": self.unit_tol,
            **fmt(total),
            "by_layer": {f"{k:03d}": fmt(a) for k, a in sorted(by_layer.items())},
            "by_head": {f"{k[0]:03d}.{k[1]:03d}": fmt(a) for k, a in sorted(self.heads.items())},
        }
