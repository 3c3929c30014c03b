"""Whether a run's first batch will compile Triton kernels, and the notice printed before it."""

from __future__ import annotations

import os
from pathlib import Path

import torch



#: Printed (unless ``--quiet``) before a run's first batch on a GPU whose Triton cache holds no compiled
#: kernel yet: fla's kernels compile and autotune on their first call, minutes of silence otherwise.
COMPILE_NOTICE = ("osdn-diag: fla compiles and autotunes its Triton kernels on their first call on this "
                  "machine: the first batch may take minutes (once; they are kept in {cache}, which "
                  "TRITON_CACHE_DIR sets; `osdn-diag warmup MODEL` does this ahead of runs)")


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels (and fla its autotuning results), as triton 3.x's
    ``knobs.cache.dir`` finds it without importing triton: ``TRITON_CACHE_DIR``, else
    ``$TRITON_HOME/.triton/cache`` with ``TRITON_HOME`` defaulting to the home directory."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME", os.path.expanduser("~/")), ".triton", "cache")


def has_compiled_kernels(cache: Path) -> bool:
    """Whether Triton's cache ``cache`` holds a compiled kernel: a ``.cubin`` (NVIDIA) or ``.hsaco``
    (AMD) in one of its per-kernel folders (the launcher stubs Triton also caches there are not
    kernels). Stops at the first one found."""
    try:
        with os.scandir(cache) as folders:
            for folder in folders:
                if folder.is_dir():
                    with os.scandir(folder.path) as files:
                        if any(f.name.endswith((".cubin", ".hsaco")) for f in files):
                            return True
    except OSError:  # no cache yet
        return False
    return False


def _compiles_kernels(device: torch.device) -> bool:
    """Whether the model's forward passes on ``device`` compile Triton kernels (fla's layers on a GPU;
    on the CPU they run interpreted)."""
    return device.type == "cuda"
