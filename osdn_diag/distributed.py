"""Several processes (``torchrun``): prompts sharded across ranks, statistics reduced exactly.

Under ``torchrun --nproc-per-node N osdn-diag run …`` every rank captures and replays the forward
batches ``b`` with ``b % N == rank`` — a deterministic split — on its own GPU (or CPU, with the gloo
backend), and writes its own shards and its own part of ``residuals.parquet`` (then a directory of
``part-RRRRR.parquet`` files that pyarrow, pandas and duckdb read as one table). The summary is
reduced on rank 0 from every rank's sufficient statistics (counts and sums, never averages of
averages), and rank 0 writes ``manifest.json`` with ``"complete": true`` only after every rank has
finished; a rank that fails makes torchrun stop the others, and the manifest then stays incomplete.
Results equal a single-process run up to the order of floating-point summation.

Several machines (``torchrun --nnodes N``): the global ``RANK`` decides which batches a process owns,
``LOCAL_RANK`` which GPU of its machine it uses. Every rank writes its parts under its own ``--out``
and a record of them, ``ranks/rank-RRRRR.json`` (run id, its shards and its part of the table, each
with its sha256). Whether ``--out`` is one directory for all (a shared file system) is found out, not
assumed: rank 0 writes the manifest first, and every rank looks for it (same run id) under its own
``--out``. Where some rank does not see it, the nodes' directories are parts of one run that
``osdn-diag merge`` assembles (see :mod:`osdn_diag.merge`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .runtime.launcher import launched_world

__all__ = ["Ranks", "current", "fault_point", "init_from_env", "shutdown"]

#: test hook: ``RANK:POINT`` makes that rank kill itself (SIGKILL, as a preempted node) at ``POINT``
FAULT_ENV = "OSDN_DIAG_FAULT"


@dataclass(frozen=True)
class Ranks:
    """This process's place among ``world`` processes (``world == 1``: no torch.distributed)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def owns(self, index: int) -> bool:
        """Whether this rank handles work item ``index`` (forward batches, shards)."""
        return index % self.world == self.rank

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order (on every rank)."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        """Rank 0's ``obj`` (on every rank); a collective: every rank must call it."""
        return self.gather(obj)[0]

    def device(self) -> torch.device | None:
        """The GPU of this rank under several processes, else ``None`` (the default applies)."""
        if self.world > 1 and torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return None


def current() -> Ranks:
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    return Ranks()


def init_from_env() -> Ranks:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1): NCCL on GPUs, gloo on CPUs."""
    if launched_world() > 1 and not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return current()


def shutdown() -> None:
    """Leave the process group, if this process joined one (torchrun warns at exit otherwise)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def fault_point(name: str) -> None:
    """Die here, as a node that loses power would (SIGKILL: no cleanup, no exception), when
    ``OSDN_DIAG_FAULT`` is ``RANK:name`` for this process's global rank. For the tests of what a dead
    rank leaves behind; unset, this does nothing."""
    want = os.environ.get(FAULT_ENV)
    if want and want == f"{current().rank}:{name}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
