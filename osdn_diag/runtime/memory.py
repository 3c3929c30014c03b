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

#: Per cgroup version: the folder below the cgroup mount that holds the memory controller's tree, and
#: its files of the limit, the usage and, in ``memory.stat``, the page cache the kernel can reclaim.
_CGROUP = (("", "memory.max", "memory.current", "inactive_file"),
           ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _reclaimable(folder: Path, key: str) -> int:
    """Page cache the kernel can drop in the cgroup ``folder`` (``key`` of its ``memory.stat``), 0 where
    unknown."""
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except (OSError, UnicodeDecodeError):
        pass
    return 0


def _cgroup_free(root: Path, self_cgroup: Path) -> int | None:
    """Bytes the cgroups this process belongs to still allow it: the least, over its own cgroup and
    each one above it, of the limit less the usage — page cache the kernel can reclaim not counted as
    used (a freshly copied checkpoint fills it). ``None`` where no limit applies or none can be read.
    The own cgroup is read from ``self_cgroup`` (``/proc/self/cgroup``): under Slurm or a systemd slice
    the limit is on it, not on the mount's root; where the mount shows the process's cgroup as its root
    (a container's namespace), the root is it."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        lines = []
    own = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            if parts[1] == "":
                own[""] = parts[2]
            elif "memory" in parts[1].split(","):
                own["memory"] = parts[2]
    free = None
    for sub, limit_name, usage_name, stat_key in _CGROUP:
        base = root / sub if sub else root
        if not (base / limit_name).is_file():
            continue
        rel = Path(own.get(sub, "/").lstrip("/"))
        folder = base / rel if (base / rel / limit_name).is_file() else base
        while True:  # the own cgroup, then each above it up to the mount's root
            limit, usage = _read_int(folder / limit_name), _read_int(folder / usage_name)
            if limit is not None and usage is not None:  # "max" (v2) reads as no limit
                left = max(limit - max(usage - _reclaimable(folder, stat_key), 0), 0)
                free = left if free is None else min(free, left)
            if folder == base:
                break
            folder = folder.parent
        break  # one hierarchy: v2's where it is mounted, else v1's
    return free


def _host_available(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup"),
                    self_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes the host can still give this process: ``MemAvailable + SwapFree`` from ``meminfo``,
    less where a cgroup limit leaves less (:func:`_cgroup_free`). ``None`` where ``meminfo`` cannot be
    read."""
    fields = {}
    try:
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * 1024
    except (OSError, UnicodeDecodeError):
        return None
    if "MemAvailable" not in fields:
        return None
    free = fields["MemAvailable"] + fields.get("SwapFree", 0)
    limited = _cgroup_free(cgroup, self_cgroup)
    return free if limited is None else min(free, limited)


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
