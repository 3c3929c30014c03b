"""Replay of fla's ``GatedDeltaProduct`` calls (family ``gated_delta_product``).

The record is the interleaved gated delta rule the kernel ran (:mod:`osdn_diag.capture.families.gated_deltaproduct`):
micro-step ``j`` of token ``t`` is row ``t·n + j``, ``n = flags["micro_steps"]``, the query on the last
micro-step, the gate on micro-step 0. Each row of the table is one micro-step write, measured like
any delta-rule write (``loss_before``, ``loss_after``, ``residual_ratio``, ``write_gain``, …, on the
micro-step's own key and value); :func:`osdn_diag.replay.call.replay_call` keeps the token's position
in ``pos``. The columns added here (:data:`COLUMNS`):

* ``step`` — the micro-step ``j`` (int32);
* ``token_ratio`` — the token's ratio ``Π_j q_{t,j}`` (the same on its n rows);
* ``token_ratio_post`` — the same product with micro-step 0's post-decay ratio (gated layers).

Backends: ``"torch"`` runs the family's own reference (:func:`osdn_diag.math.family_gated_deltaproduct.gated_deltaproduct_recurrence`)
on the token form of the record; ``"triton"`` runs the package's fused delta-rule replay on the
interleaved record (the same recurrence) and derives the token columns from its losses; so does
``"torch"`` for a record with a write key of its own (``what-if``'s ``d ⊙ k``), through the torch
delta-rule reference.
"""

from __future__ import annotations

import torch

from ...math.family_gated_deltaproduct import gated_deltaproduct_recurrence, token_columns
from ...math.recurrence import RecurrenceResult
from ..call import recurrence_inputs

__all__ = ["COLUMNS", "REPLAYS", "replay_gated_deltaproduct"]

COLUMNS = (("step", "int32"), "token_ratio", "token_ratio_post")


def _where(call) -> str:
    return f"layer {call.layer} ({call.layer_name}, kernel {call.kernel})"


def _token_form(x: torch.Tensor | None, n: int, at: int, call, name: str) -> torch.Tensor | None:
    """The token tensor held at micro-step ``at`` of an interleaved one; the other micro-steps must
    be zero (fla places the query and the gate on one micro-step), else the record is not this
    family's."""
    if x is None:
        return None
    B, Tn = x.shape[:2]
    y = x.reshape(B, Tn // n, n, *x.shape[2:])
    others = torch.cat([y[:, :, :at % n], y[:, :, at % n + 1:]], dim=2)
    if bool((others != 0).any()):
        raise ValueError(
            f"{_where(call)}: {name} is nonzero off micro-step {at % n} of some token; a "
            f"GatedDeltaProduct record holds it on that micro-step only"
        )
    return y[:, :, at]


def replay_gated_deltaproduct(call, *, dtype, bad, backend) -> RecurrenceResult:
    """Replay one call (see the module docstring); the result is in the record's micro-step layout
    (``o: [B, T·n, H, V]``, per-row values ``[B, T·n, H]``)."""
    n = int(call.flags.get("micro_steps", 1))
    if call.k.shape[1] % n:
        raise ValueError(f"{_where(call)}: {call.k.shape[1]} micro-steps are not whole tokens of {n}")
    args = recurrence_inputs(call, dtype, bad)
    if backend == "triton" or args["write_key"] is not None:
        # The fused replay (triton), or a write key other than the micro-step key — what-if's
        # counterfactual d ⊙ k, which the family's reference does not take: the delta rule on the
        # interleaved record, which is this family's recurrence with any write key.
        if backend == "triton":
            from ...ops.replay import fused_replay as run
        else:
            from ...math.recurrence import delta_rule_recurrence as run
        res = run(**args)
        res.columns = token_columns(res.loss_before, res.loss_after, res.loss_before_decayed, n)
        return res
    cu = args["cu_seqlens"]
    if cu is not None and bool((cu % n != 0).any()):
        raise ValueError(f"{_where(call)}: cu_seqlens {cu.tolist()} are not whole tokens of {n}")
    res = gated_deltaproduct_recurrence(
        _token_form(args["q"], n, -1, call, "q"), args["k"], args["v"], args["beta"], n,
        g=_token_form(args["g"], n, 0, call, "g"), scale=args["scale"],
        initial_state=args["initial_state"], cu_seqlens=None if cu is None else cu // n, dtype=dtype,
    )
    B, T = res.o.shape[:2]
    o = res.o.new_zeros(B, T, n, *res.o.shape[2:])
    o[:, :, -1] = res.o  # the read-out happens at the token's last micro-step (q is zero elsewhere)
    res.o = o.reshape(B, T * n, *res.o.shape[2:])
    return res


REPLAYS = {"gated_delta_product": replay_gated_deltaproduct}
