"""Capture: what fla's delta-rule kernels received, recorded per layer call, in memory or on disk."""

from .record import KernelCall
from .store import CaptureReader, CaptureWriter, StoredCall

__all__ = ["CaptureReader", "CaptureWriter", "KernelCall", "StoredCall"]
