"""Whether this process is one of several a launcher (``torchrun``) started, as its environment says,
read without importing torch.

torchrun describes the group in ``WORLD_SIZE`` and ``RANK``; :func:`osdn_diag.distributed.init_from_env`
joins a group only where ``WORLD_SIZE`` > 1, and everything that asks "am I rank 0?" before the group
exists (the directory lock, the report's figure workers) asks the same question here. A ``RANK`` left in
the environment of a single process (``WORLD_SIZE`` unset or 1) describes no group: that process is
rank 0 of one.
"""

from __future__ import annotations

import os

__all__ = ["launched_rank", "launched_world"]


def launched_world() -> int:
    """``WORLD_SIZE`` (1 when unset). A value that is not a whole number is refused
    (:class:`ValueError` naming the variable)."""
    text = os.environ.get("WORLD_SIZE", "1").strip() or "1"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={text!r}: expected the number of processes (torchrun sets it); "
                         "unset it to run one process") from None


def launched_rank() -> int:
    """This process's rank in the group its launcher describes (``RANK`` where ``WORLD_SIZE`` > 1),
    0 for a process of its own, whatever ``RANK`` says. An unreadable ``WORLD_SIZE`` or ``RANK``
    gives 0: the process then behaves as rank 0 (it locks), and joining the group refuses it."""
    try:
        if launched_world() <= 1:
            return 0
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
