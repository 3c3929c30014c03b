"""A model command's GPU context, created on a thread while the command imports torch, transformers and fla.

The first CUDA call of a process creates the GPU's primary context (the driver's ``cuInit`` and
``cuDevicePrimaryCtxRetain``): 0.3 s on an H200 host, paid after the imports (6–9 s there) when the
model is built. Called through ``ctypes``, which releases the GIL, the driver does it on a thread
while the main thread imports; torch's runtime then retains the same primary context (the runtime API
uses the device's primary context) and finds it made.

It applies only where the GPU is known before torch is imported and is the one torch will use:
``--device cuda:N`` (ordinal ``N``), or ``--device cuda`` / no ``--device`` (ordinal 0, torch's current
device in a fresh process), outside ``torchrun`` (whose ranks pick their GPU from ``LOCAL_RANK`` later)
and outside Triton's interpreter. No driver, no GPU, a failing call or ``OSDN_DIAG_CUDA_CONTEXT=off``:
nothing is done, and torch creates the context itself as usual. The context is never released (torch
keeps its own reference until the process exits).
"""

from __future__ import annotations

import ctypes
import os
import threading

__all__ = ["ENV", "context_ordinal", "start_context"]

ENV = "OSDN_DIAG_CUDA_CONTEXT"


def context_ordinal(device: str | None) -> int | None:
    """The CUDA ordinal whose context a command with ``--device device`` will create first, if that is
    known without torch; ``None`` where it is not (CPU, torchrun, the interpreter, ``off``)."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return None
    if os.environ.get("TRITON_INTERPRET") == "1" or "LOCAL_RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return None
    if device is None or device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None  # the CPU, or a spelling torch will judge


def _retain(ordinal: int) -> bool:
    """``cuInit`` and ``cuDevicePrimaryCtxRetain`` of ``ordinal``; False where any step fails."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    # The driver reads this as it initialises, and torch sets the same value before its own first call;
    # all of CUDA 12.2 and later default to it.
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    count, dev, ctx = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_void_p()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or not 0 <= ordinal < count.value:
        return False
    if cuda.cuDeviceGet(ctypes.byref(dev), ordinal) != 0:
        return False
    return cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0


def start_context(device: str | None) -> threading.Thread | None:
    """Start creating the context of the GPU a model command with ``--device device`` will use, on a
    daemon thread (returned; ``None`` where :func:`context_ordinal` knows no GPU). Failures are silent:
    torch then creates the context itself."""
    ordinal = context_ordinal(device)
    if ordinal is None:
        return None

    def run() -> None:
        try:
            _retain(ordinal)
        except Exception:  # noqa: BLE001 - torch creates the context itself and reports what is wrong
            pass

    thread = threading.Thread(target=run, name="cuda-context", daemon=True)
    thread.start()
    return thread
