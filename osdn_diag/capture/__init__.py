"""Capture: what fla's delta-rule kernels received, recorded per layer call, in memory or on disk.

The package is callable: ``osdn_diag.capture(model)`` is :func:`osdn_diag.capture.context.capture`.
"""

from ..runtime.callable_module import make_callable
from .context import Capture, capture
from .record import KernelCall
from .store import CaptureReader, CaptureWriter, StoredCall

__all__ = ["Capture", "CaptureReader", "CaptureWriter", "KernelCall", "StoredCall", "capture"]

make_callable(__name__, "capture")
