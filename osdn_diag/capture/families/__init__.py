"""Capture adapters for fla 0.6.0's further delta-rule families, one module per family.

Each module defines its adapters (subclasses of :class:`osdn_diag.capture.adapters.Adapter`) and a
``SITES`` tuple of :class:`osdn_diag.capture.adapters.KernelSite`: the kernel entry points as the
family's fla layer module imports them. :func:`sites` gathers them for
:data:`osdn_diag.capture.adapters.ADAPTERS`. docs/families.md states, per family, the recurrence,
the token-local loss whose contraction is measured, and how the kernel's arguments map onto the
record (:mod:`osdn_diag.capture.record`).
"""

from __future__ import annotations

__all__ = ["sites"]

#: The family modules, in the order their sites are listed.
MODULES: tuple[str, ...] = ("comba", "gdn2", "gated_deltaproduct", "momentum_delta_rule", "rwkv7")


def sites() -> tuple:
    """Every family module's ``SITES``, in :data:`MODULES` order."""
    import importlib

    out: list = []
    for name in MODULES:
        out.extend(importlib.import_module(f".{name}", __name__).SITES)
    return tuple(out)
