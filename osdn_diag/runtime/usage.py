"""The error every check of a user's input raises, and the limits of a run's size, importable
without torch: the command line's checks (:mod:`osdn_diag.cli.checks`) and the prompt suites
(:mod:`osdn_diag.prompts`) refuse the same inputs with the same words."""

from __future__ import annotations

import math

__all__ = ["MAX_LENGTH", "MAX_PROMPTS", "MAX_SUITE_TOKENS", "UsageError", "check_suite_size", "what_if_settings_error"]


class UsageError(ValueError):
    """An argument or input file the command cannot use; the message names it and what to do."""


#: Bounds on a built-in suite's size, far above any run that fits a machine: --length 10^12 tried to
#: allocate 8 TB, --num-prompts 10^11 drew prompts silently for minutes before anything ran.
MAX_LENGTH = 1 << 20          # tokens per prompt
MAX_PROMPTS = 1 << 20
MAX_SUITE_TOKENS = 1 << 28    # prompts × length: ~2.7e8 tokens (paper-scale runs: ~1e5)


def check_suite_size(num_prompts: int, length: int) -> None:
    """Refuse a built-in suite too large to run (:data:`MAX_LENGTH`, :data:`MAX_PROMPTS`,
    :data:`MAX_SUITE_TOKENS`), up front, naming the argument: it would fail on memory after minutes,
    or run for days."""
    if length > MAX_LENGTH:
        raise UsageError(f"argument --length: {length:,} tokens per prompt is more than the {MAX_LENGTH:,} "
                         "a run supports; give a shorter length")
    if num_prompts > MAX_PROMPTS:
        raise UsageError(f"argument --num-prompts: {num_prompts:,} prompts is more than the {MAX_PROMPTS:,} "
                         "a run supports; split the work over several runs")
    if num_prompts * length > MAX_SUITE_TOKENS:
        raise UsageError(f"arguments --num-prompts, --length: {num_prompts:,} × {length:,} = "
                         f"{num_prompts * length:,} tokens is more than the {MAX_SUITE_TOKENS:,} a run "
                         "supports (its capture alone would take ~2 KB per token, head and layer); use "
                         "fewer or shorter prompts")


def what_if_settings_error(eta, d_min, d_max, retention, *, name=str, arg=lambda n: f"'{n}'") -> str | None:
    """What is wrong with a what-if's settings (``None`` if nothing): finite numbers, ``eta >= 0``,
    ``0 < d_min <= 1 <= d_max`` (d starts at 1), ``retention`` in [0, 1]. One rule for the command
    line (``--d-min``) and :class:`osdn_diag.whatif.WhatIf` (``'d_min'``): ``name`` spells a setting,
    ``arg`` quotes it."""
    values = {"eta": eta, "d_min": d_min, "d_max": d_max, "retention": retention}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return f"argument {arg(name(key))}: expected a finite number, got {value!r}"
    if not eta >= 0:
        return f"argument {arg(name('eta'))}: expected a step size >= 0, got {eta}"
    if not 0 < d_min <= d_max:
        lo, hi = name("d_min"), name("d_max")
        return f"arguments {arg(lo)}, {arg(hi)}: expected 0 < {lo} <= {hi}, got {d_min} and {d_max}"
    if not d_min <= 1 <= d_max:  # phase 1 starts every sequence at d0 = 1, which must lie in the box
        lo, hi = name("d_min"), name("d_max")
        return (f"arguments {arg(lo)}, {arg(hi)}: the box [{d_min}, {d_max}] must contain 1, where the "
                f"preconditioner d starts; give {lo} <= 1 <= {hi}")
    if not 0 <= retention <= 1:
        return f"argument {arg(name('retention'))}: expected a value in [0, 1], got {retention}"
    return None
