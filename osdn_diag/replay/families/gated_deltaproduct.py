"""Replay of fla's ``GatedDeltaProduct`` calls (family ``gated_delta_product``).

The record is the interleaved gated delta rule the kernel ran (:mod:`osdn_diag.capture.families.gated_deltaproduct`):
micro-step ``j`` of token ``t`` is row ``t·n + j``, ``n = flags["micro_steps"]``, the query on the last
micro-step, the gate on micro-step 0. Each row of the table is one micro-step write, measured like
any delta-rule write (``loss_before``, ``loss_after``, ``residual_ratio``, ``write_gain``, …, on the
micro-step's own key and value); :func:`osdn_diag.replay.call.replay_call` keeps the token's position
in ``pos``. The columns added here (:data:`COLUMNS`; :mod:`osdn_diag.math.family_gated_deltaproduct`
defines them), a token's values repeated on its n rows:

* ``step`` — the micro-step ``j`` (int32);
* ``token_ratio`` — the ratio of the token's loss ``L_t(S) = Σ_j ½‖S k_{t,j} − v_{t,j}‖²`` after its
  last micro-step to before its decay, ``L_t(S_t) / L_t(S_{t−1})``; ``token_ratio_post`` the same
  against the decayed state ``α_t S_{t−1}`` (gated layers);
* ``micro_step_ratio_product`` (``_post``) — the product of its micro-steps' ratios ``Π_j q_{t,j}``,
  each the ratio of its own pair's loss;
* ``token_loss_before``, ``token_loss_before_decayed`` (gated), ``token_loss_after`` — ``L_t`` at
  ``S_{t−1}``, ``α_t S_{t−1}``, ``S_t``.

Backends: ``"torch"`` runs the family's own reference (:func:`osdn_diag.math.family_gated_deltaproduct.gated_deltaproduct_recurrence`)
on the token form of the record; ``"triton"`` runs the package's fused delta-rule replay on a
*probed* form of the record (:func:`probed_record`), and so does ``"torch"`` for a record with a
write key of its own (``what-if``'s ``d ⊙ k``), through the torch delta-rule reference. A probe is a
row with β = 0: it leaves the state exactly as it is (``S + 0·u kᵀ``) and its ``loss_before`` is one
pair's loss at the state it sits at, which is how the token's loss is read, pair by pair, at the
states before and after the token with the delta rule's own kernel.
"""

from __future__ import annotations

import torch

from ...math.family_gated_deltaproduct import gated_deltaproduct_recurrence, token_columns
from ...math.recurrence import RecurrenceResult
from ..call import recurrence_inputs

__all__ = ["COLUMNS", "REPLAYS", "probed_record", "replay_gated_deltaproduct"]

COLUMNS = (("step", "int32"), "token_ratio", "token_ratio_post", "micro_step_ratio_product",
           "micro_step_ratio_product_post", "token_loss_before", "token_loss_before_decayed", "token_loss_after")


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


def _probe_layout(n: int, gated: bool) -> list[tuple[str, int]]:
    """One token's rows in the probed record, in order, as ``(kind, j)``: ``"pre"`` probes read pair
    ``j``'s loss at ``S_{t−1}`` (gated only; pair 0's is the gated probe's own ``loss_before``);
    ``"decayed"`` probes at ``α_t S_{t−1}`` (the first carries the token's gate, so its
    ``loss_before`` is pair 0's loss at ``S_{t−1}`` and its ``loss_before_decayed`` at
    ``α_t S_{t−1}``; without a gate they read ``S_{t−1}``); ``"write"`` rows are the token's
    micro-steps (the query on the last); ``"after"`` probes read pair ``j < n − 1`` at ``S_t`` (pair
    ``n − 1``'s is the last write's ``loss_after``)."""
    return ([("pre", j) for j in range(1, n)] if gated else []) + [("decayed", j) for j in range(n)] + [
        ("write", j) for j in range(n)] + [("after", j) for j in range(n - 1)]


def probed_record(args: dict, n: int) -> tuple[dict, list[tuple[str, int]]]:
    """The delta-rule inputs of :func:`osdn_diag.replay.call.recurrence_inputs` (interleaved, ``n``
    micro-steps per token, ``q`` on the last, ``g`` on micro-step 0 only: callers check) rebuilt with
    probes (:func:`_probe_layout`): ``m`` rows per token instead of ``n``, ``cu_seqlens`` scaled to
    match. Returns the inputs and the layout (one token's ``m`` rows)."""
    gated = args["g"] is not None
    layout = _probe_layout(n, gated)
    m = len(layout)
    k = args["k"]
    B, Tn = k.shape[:2]
    T = Tn // n
    dev = k.device
    j_of = torch.tensor([j for _, j in layout], device=dev)
    src = (torch.arange(T, device=dev)[:, None] * n + j_of).reshape(-1)  # micro-step row of each row
    writes = torch.tensor([kind == "write" for kind, _ in layout], device=dev)

    def at(row: int, x: torch.Tensor) -> torch.Tensor:
        # x's token values ([B, T, ...], from micro-step row ``row`` of each token) on the layout's
        # row ``row``, zeros on the others
        y = x.new_zeros(B, T, m, *x.shape[2:])
        y[:, :, row] = x
        return y.reshape(B, T * m, *x.shape[2:])

    def token(x: torch.Tensor, j: int) -> torch.Tensor:
        return x.reshape(B, T, n, *x.shape[2:])[:, :, j]

    out = dict(args)
    out["k"], out["v"] = k[:, src], args["v"][:, src]
    if args["write_key"] is not None:
        out["write_key"] = args["write_key"][:, src]
    out["beta"] = args["beta"][:, src] * writes.repeat(T).to(args["beta"].dtype)[None, :, None]
    out["q"] = at(layout.index(("write", n - 1)), token(args["q"], n - 1))
    if gated:
        out["g"] = at(layout.index(("decayed", 0)), token(args["g"], 0))
    if args["cu_seqlens"] is not None:
        out["cu_seqlens"] = args["cu_seqlens"] // n * m
    return out, layout


def _from_probes(res: RecurrenceResult, layout, n: int) -> RecurrenceResult:
    """The probed replay's result back in the record's micro-step layout, with the token columns."""
    m = len(layout)
    B, Tm, H = res.loss_before.shape
    T = Tm // m
    row = {key: i for i, key in enumerate(layout)}
    writes = [row["write", j] for j in range(n)]

    def pick(x: torch.Tensor, rows: list[int]) -> torch.Tensor:  # [B, T·m, ...] -> [B, T·len(rows), ...]
        y = x.reshape(B, T, m, *x.shape[2:])[:, :, rows]
        return y.reshape(B, T * len(rows), *x.shape[2:])

    def pair(kind: str, j: int, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        return x.reshape(B, T, m, H)[:, :, row[kind, j]]

    lb, la = res.loss_before, res.loss_after
    gated = res.loss_before_decayed is not None
    # Micro-step 0's loss before: the gated probe's, read where the write itself would read it.
    loss_before = pick(lb, writes).reshape(B, T, n, H).clone()
    loss_before[:, :, 0] = pair("decayed", 0, lb)
    loss_before = loss_before.reshape(B, T * n, H)
    decayed = None
    tokens = {"after": pair("write", n - 1, la) + sum(pair("after", j, lb) for j in range(n - 1))}
    if gated:
        d = pick(res.loss_before_decayed, writes).reshape(B, T, n, H).clone()
        d[:, :, 0] = pair("decayed", 0, res.loss_before_decayed)
        decayed = d.reshape(B, T * n, H)
        tokens["before"] = pair("decayed", 0, lb) + sum(pair("pre", j, lb) for j in range(1, n))
        tokens["before_decayed"] = pair("decayed", 0, res.loss_before_decayed) + sum(
            pair("decayed", j, lb) for j in range(1, n))
    else:
        tokens["before"] = sum(pair("decayed", j, lb) for j in range(n))
    loss_after = pick(la, writes)
    return RecurrenceResult(
        o=pick(res.o, writes), final_state=res.final_state, loss_before=loss_before, loss_after=loss_after,
        write_gain=pick(res.write_gain, writes), loss_before_decayed=decayed,
        columns=token_columns(loss_before, loss_after, decayed, n, tokens),
    )


def replay_gated_deltaproduct(call, *, dtype, bad, backend) -> RecurrenceResult:
    """Replay one call (see the module docstring); the result is in the record's micro-step layout
    (``o: [B, T·n, H, V]``, per-row values ``[B, T·n, H]``)."""
    n = int(call.flags.get("micro_steps", 1))
    if call.k.shape[1] % n:
        raise ValueError(f"{_where(call)}: {call.k.shape[1]} micro-steps are not whole tokens of {n}")
    args = recurrence_inputs(call, dtype, bad)
    cu = args["cu_seqlens"]
    if cu is not None and bool((cu % n != 0).any()):
        raise ValueError(f"{_where(call)}: cu_seqlens {cu.tolist()} are not whole tokens of {n}")
    q_tok, g_tok = _token_form(args["q"], n, -1, call, "q"), _token_form(args["g"], n, 0, call, "g")
    if backend == "triton" or args["write_key"] is not None:
        # The fused replay (triton), or a write key other than the micro-step key — what-if's
        # counterfactual d ⊙ k, which the family's reference does not take: the delta rule on the
        # probed record, which is this family's recurrence with any write key.
        if backend == "triton":
            from ...ops.replay import fused_replay as run
        else:
            from ...math.recurrence import delta_rule_recurrence as run
        if n == 1:  # one write per token: the token's loss is the write's, no probe needed
            res = run(**args)
            tokens = {"before": res.loss_before, "after": res.loss_after}
            if res.loss_before_decayed is not None:
                tokens["before_decayed"] = res.loss_before_decayed
            res.columns = token_columns(res.loss_before, res.loss_after, res.loss_before_decayed, 1, tokens)
            return res
        probed, layout = probed_record(args, n)
        return _from_probes(run(**probed), layout, n)
    res = gated_deltaproduct_recurrence(
        q_tok, args["k"], args["v"], args["beta"], n, g=g_tok, scale=args["scale"],
        initial_state=args["initial_state"], cu_seqlens=None if cu is None else cu // n, dtype=dtype,
    )
    B, T = res.o.shape[:2]
    o = res.o.new_zeros(B, T, n, *res.o.shape[2:])
    o[:, :, -1] = res.o  # the read-out happens at the token's last micro-step (q is zero elsewhere)
    res.o = o.reshape(B, T * n, *res.o.shape[2:])
    return res


REPLAYS = {"gated_delta_product": replay_gated_deltaproduct}
