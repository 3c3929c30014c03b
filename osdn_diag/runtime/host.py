"""Small tensors from host values, on a device, without waiting for it.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, which makes the host wait
until the GPU has finished everything queued before the copy. In the replay of a captured call that
happens after the replay kernel is launched (the table's index, the comparator's problems, the ratio
statistics' lengths), so the host would sit idle for the kernel instead of queueing the work after it.
Through a pinned buffer the copy is queued like a kernel (the caching host allocator keeps the buffer
until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["from_host", "to_device"]


def from_host(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``; on a GPU the copy is queued on the current
    stream rather than waited for."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``; on a GPU, copied through pinned memory and queued on the current
    stream rather than waited for."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
