"""Argument checks shared by the OSDN-style layers (:class:`~osdn_diag.layers.OSDN`,
:class:`~osdn_diag.layers.OSGDN`) and their model configs.

They run before any module is built, so that a bad box or step size is a ``ValueError`` naming the
argument rather than a failure deep inside phase 1.
"""

from __future__ import annotations

import math

from .._checks import check_box

__all__ = ["check_osdn_args"]


def _is_number(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


def check_osdn_args(*, eta: object, d_min: object, d_max: object, phase1_eps: object) -> None:
    """Check the phase-1 hyper-parameters; raise ``ValueError`` naming the first bad one.

    * ``eta``: a finite number ``>= 0``;
    * ``d_min``, ``d_max``: finite numbers with ``0 < d_min <= d_max`` (the layers need a box);
    * ``phase1_eps``: a number ``> 0``.
    """
    if not _is_number(eta) or not math.isfinite(eta) or eta < 0:
        raise ValueError(f"argument 'eta': expected a finite number >= 0, got {eta!r}")
    for name, val in (("d_min", d_min), ("d_max", d_max)):
        if not _is_number(val) or not math.isfinite(val):
            raise ValueError(f"argument {name!r}: expected a finite number, got {val!r}")
    check_box(d_min, d_max)  # 'd_min' > 0, 'd_max' >= d_min
    if not (isinstance(phase1_eps, (int, float)) and phase1_eps > 0):
        raise ValueError(f"argument 'phase1_eps': expected a number > 0, got {phase1_eps!r}")
