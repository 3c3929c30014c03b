"""Theorem D.7's hypotheses on one stream: the single definition the audit, ``comparator.parquet``,
``summary.json`` and the report all use.

A *stream* is one (prompt, layer, head) sequence of writes — one row of ``comparator.parquet``. Its
tokens are Theorem D.7's valid tokens: finite inputs and, under ``--zero-residual drop``, a non-zero
residual (the replay's ``theorem_valid``). **The hypotheses hold for a stream** when every check of
:data:`HYPOTHESES` passes:

* ``unit_keys`` — ``max |‖k_t‖² − 1| ≤ key_norm_tol`` over the valid tokens, with the tolerance of
  :func:`key_norm_tol` for the dtype the kernel read its keys in;
* ``beta_in_open_unit_interval`` — ``0 < β_t < 1`` at every valid token;
* ``d_in_box`` — every ``d_t`` at a valid token inside ``[d_min, d_max]^K`` (``d ≡ 1`` without a
  preconditioner);
* ``no_decay`` — the layer does not decay its state (Lemma 4.1's ``q_t = (1 − a_t)²`` is a statement
  about the ratio against the undecayed state);
* ``has_valid_token`` — at least one valid token.

The first four are vacuously true on a stream without valid tokens, so each failing stream is
counted against the hypotheses it actually breaks.

**The key-norm tolerance.** A key the model normalised to unit length reaches the kernel rounded to
the dtype the kernel reads it in: each entry moves by at most a relative ``u`` (the dtype's unit
roundoff), so ``‖k‖²`` by at most ``(1 + u)² − 1`` — 7.8e-3 for bf16, 1.2e-7 for fp32. That much is
the capture's rounding, not the model. On top of it :data:`KEY_NORM_BASE_TOL` = 1e-3 is allowed for
the normalisation itself (computed in fp32, with an ``eps`` under the square root). So
``key_norm_tol("bfloat16") = 1e-3 + 7.8e-3`` and ``key_norm_tol("float32") = 1e-3 + 1.2e-7``.
"""

from __future__ import annotations

import torch

from ..capture.kernel_inputs import unit_roundoff

__all__ = ["HYPOTHESES", "KEY_NORM_BASE_TOL", "check", "count", "key_norm_tol", "key_rounding_bound"]

#: The checks, in the order the report names them.
HYPOTHESES = ("unit_keys", "beta_in_open_unit_interval", "d_in_box", "no_decay", "has_valid_token")

#: Largest ``|‖k‖² − 1|`` counted as a unit key before the dtype's rounding is added: the model's own
#: normalisation (fp32, ``k / sqrt(‖k‖² + eps)``) and the replay's fp32 norms stay far inside it.
KEY_NORM_BASE_TOL = 1e-3


def key_rounding_bound(read_as: str) -> float:
    """The largest ``|‖k‖² − 1|`` that rounding a unit key to ``read_as`` can cause: ``(1 + u)² − 1``."""
    return (1.0 + unit_roundoff(read_as)) ** 2 - 1.0


def key_norm_tol(read_as: str, base: float = KEY_NORM_BASE_TOL) -> float:
    """The tolerance of ``unit_keys`` for keys the kernel read in dtype ``read_as`` (a name such as
    ``"bfloat16"``, as ``KernelCall.flags["qk_read_as"]``): ``base + (1 + u)² − 1``."""
    return base + key_rounding_bound(read_as)


def check(
    n_valid: torch.Tensor,
    max_unit_dev: torch.Tensor,
    beta_min: torch.Tensor,
    beta_max: torch.Tensor,
    d_in_box: torch.Tensor,
    decay: torch.Tensor | bool,
    tol: torch.Tensor | float,
) -> dict[str, torch.Tensor]:
    """Every check of :data:`HYPOTHESES` and ``hypotheses_hold`` for ``P`` streams.

    Args:
        n_valid: ``[P]`` valid tokens per stream.
        max_unit_dev, beta_min, beta_max: ``[P]`` over the valid tokens (any value, NaN included,
            where ``n_valid = 0``: not read there).
        d_in_box: ``[P]`` bool, every ``d_t`` at a valid token inside the box.
        decay: ``[P]`` bool or one bool, whether the stream's layer decays its state.
        tol: ``[P]`` or one number, the stream's key-norm tolerance (:func:`key_norm_tol`).

    Returns:
        ``{name: [P] bool}`` for each of :data:`HYPOTHESES`, then ``hypotheses_hold`` (all of them).
    """
    has = n_valid > 0
    # A Python bool or number stays one (a tensor made from it on a GPU would be a copy from the host
    # that waits for the GPU's queued work).
    if isinstance(decay, torch.Tensor):
        decay = decay.to(has.device).expand_as(has)
    else:
        decay = torch.full_like(has, bool(decay))
    if isinstance(tol, torch.Tensor):
        tol = tol.to(device=has.device, dtype=torch.float64)
    else:
        tol = float(tol)
    flags = {
        "unit_keys": ~has | (max_unit_dev.double() <= tol),
        "beta_in_open_unit_interval": ~has | ((beta_min > 0) & (beta_max < 1)),
        "d_in_box": ~has | d_in_box.bool(),
        "no_decay": ~decay.bool(),
        "has_valid_token": has,
    }
    # Every check at once (one stack and one reduction, not a conjunction per check); "has_valid_token"
    # is among them.
    hold = torch.stack([flags[name] for name in HYPOTHESES]).all(0)
    return {**flags, "hypotheses_hold": hold}


def count(flags: dict) -> dict:
    """``{"streams", "hypotheses_hold", "hypotheses_failed": {check: streams failing it}}`` from the
    per-stream flags of :func:`check` (tensors or arrays of one length)."""
    hold = flags["hypotheses_hold"]
    return {
        "streams": int(len(hold)),
        "hypotheses_hold": int(hold.sum()),
        "hypotheses_failed": {name: int((~flags[name]).sum()) for name in HYPOTHESES},
    }
