"""How many CPUs this process may use: its share of the node (an affinity mask set by SLURM, a
container's cpuset or ``taskset``), not the node's count, which ``os.cpu_count`` gives."""

from __future__ import annotations

import os

__all__ = ["usable_cpus"]


def usable_cpus() -> int:
    """The CPUs this process may run on (``os.cpu_count()`` where the platform has no affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1
