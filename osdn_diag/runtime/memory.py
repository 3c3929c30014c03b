"""How much memory a device has free for a model's parameters, read before the model is built.

A model directory's ``config.json`` fixes the size of the model built from it, whatever its weights
hold: a config that lists only ``model_type`` builds that family's default size (transformers'
``LlamaConfig()`` is 6.7 B parameters, 25 GiB in fp32). Built on a machine without that much memory,
the process is killed by the kernel's out-of-memory killer — no message, and other work on a shared
machine may go with it. :func:`available_bytes` is what the loader compares the model's size with
before anything is allocated.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["available_bytes", "gib"]

#: cgroup v2 and v1 files of the limit and usage of the container this process runs in.
_CGROUP = (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"))


def _host_available(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the host can still give this process: ``MemAvailable + SwapFree`` from ``meminfo``,
    less where the limit of the cgroup (v2 or v1, under ``cgroup``) leaves less. ``None`` where
    ``meminfo`` cannot be read."""
    fields = {}
    try:
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * 1024
    except OSError:
        return None
    if "MemAvailable" not in fields:
        return None
    free = fields["MemAvailable"] + fields.get("SwapFree", 0)
    for limit_name, usage_name in _CGROUP:
        try:
            limit = (cgroup / limit_name).read_text().strip()
            usage = int((cgroup / usage_name).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit():  # "max": no limit; v1 writes a huge number, which min() ignores
            free = min(free, max(int(limit) - usage, 0))
        break
    return free


def available_bytes(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device`` (a CPU or one CUDA GPU), or ``None`` where that cannot
    be known (other devices, no ``/proc/meminfo``). A GPU's figure is the driver's free memory plus
    what torch's caching allocator holds unused."""
    if device.type == "cpu":
        return _host_available()
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free) + int(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    return None


def gib(n: int) -> str:
    """``n`` bytes in GiB as a user reads it: ``25.1 GiB``, ``0.02 GiB``."""
    value = n / 2**30
    return f"{value:.1f} GiB" if value >= 1 else f"{value:.2g} GiB"
