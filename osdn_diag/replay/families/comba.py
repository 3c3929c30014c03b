"""Replay of Comba (family ``"comba"``, fla's ``chunk_comba`` / ``fused_recurrent_comba``).

The record holds the removal key ``p`` in ``k`` and the write key in ``write_key``
(:mod:`osdn_diag.capture.families.comba`); the recurrence is
:func:`osdn_diag.math.family_comba.comba_recurrence`, whose residual reads the state before the
token's decay — an order the delta-rule replays (residual after the decay) do not run. The torch
reference serves both backends: ``backend="triton"`` runs it too, on the call's device.
"""

from __future__ import annotations

from ...math.family_comba import ALT_COLUMN, comba_recurrence
from ..call import zero_nonfinite

__all__ = ["COLUMNS", "REPLAYS"]


def replay_comba(call, *, dtype, bad, backend):
    """Every write of one Comba call recomputed in ``dtype``; tokens marked ``bad`` replayed on zeros."""
    if call.write_key is None:
        raise ValueError(
            f"layer {call.layer} ({call.layer_name}, kernel {call.kernel}): a Comba record needs its "
            "write key (write_key) beside the removal key p (k)"
        )
    q, p, k, v, beta, g = call.q, call.k, call.write_key, call.v, call.beta, call.g
    init = call.initial_state
    if bad is not None:
        q, p, k, v, beta, g = (zero_nonfinite(x, bad) for x in (q, p, k, v, beta, g))
        if init is not None:
            init = init.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return comba_recurrence(
        q, p, k, v, beta, g=g, scale=call.scale, initial_state=init, cu_seqlens=call.cu_seqlens, dtype=dtype,
    )


REPLAYS = {"comba": replay_comba}
COLUMNS = (ALT_COLUMN,)
