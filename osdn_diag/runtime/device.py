"""Where the work runs: a CUDA GPU, or a CPU under Triton's interpreter.

fla's layers call Triton kernels besides the delta rule (short convolution, norms, gates). On a
machine without CUDA those only run under Triton's interpreter, which must be switched on *before*
triton or fla is imported. :func:`prepare` does that once, at the start of a command, and applies the
interpreter fixes fla 0.6.0 needs (:mod:`osdn_diag.runtime.interpret`). The delta-rule kernel itself is then
replaced by the reference recurrence during capture (``kernels="auto"``), which is exact and far
faster than interpreting it.
"""

from __future__ import annotations

import os
import sys

import torch

from .fla_import import is_lazy

__all__ = ["check_device", "default_device", "prepare"]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def check_device(device: str | torch.device | None, argument: str = "device") -> torch.device | None:
    """``device`` as a ``torch.device`` (None stays None); a CUDA device where torch sees no GPU is
    refused naming ``argument`` (torch's own refusal is a bare ``AssertionError`` at the first tensor)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        why = "this torch was built without CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"argument '{argument}': {str(device)!r} asked for, but torch sees no CUDA GPU here "
                         f"({why}); use the CPU (device='cpu', or leave it out)")
    return device


def prepare(device: str | torch.device | None = None) -> torch.device:
    """Make fla importable and runnable on ``device`` (default: CUDA if present, else CPU)."""
    device = check_device(device) if device is not None else default_device()
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            # (fla loaded through shells has built no kernel yet: osdn_diag.runtime.fla_import)
            if "triton" in sys.modules or ("fla" in sys.modules and not is_lazy()):
                from .interpret import InterpreterUnavailable

                raise InterpreterUnavailable(
                    "running fla on the CPU needs TRITON_INTERPRET=1 before triton or fla is imported; "
                    "set it in the environment (export TRITON_INTERPRET=1) and start again"
                )
            os.environ["TRITON_INTERPRET"] = "1"
        from .interpret import enable_fla_interpreter

        enable_fla_interpreter()
    return device
