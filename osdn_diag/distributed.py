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

import math
import os
import re
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .runtime.launcher import launched_world

__all__ = ["Ranks", "RendezvousError", "current", "fault_point", "init_from_env", "rendezvous_timeout", "shutdown"]

#: how long joining the process group waits for the other ranks, in seconds (see :func:`init_from_env`)
RENDEZVOUS_ENV = "OSDN_DIAG_RENDEZVOUS_TIMEOUT"
RENDEZVOUS_TIMEOUT = 300.0
RENDEZVOUS_MAX = 7 * 24 * 3600.0

#: test hook: ``RANK:POINT`` makes that rank kill itself (SIGKILL, as a preempted node) at ``POINT``
FAULT_ENV = "OSDN_DIAG_FAULT"


class RendezvousError(ConnectionError):
    """The process group could not be joined at ``MASTER_ADDR``:``MASTER_PORT`` (a host name that does
    not resolve, a port that is taken or not a port, torch's store unreachable): one line naming both
    and what to check, where torch would end in its traceback (an ``OSError``: the user's setting)."""


#: getaddrinfo's answers that a name does not resolve (EAI_AGAIN, a name server that did not answer in
#: time, is left to torch, which tries again).
_NOT_RESOLVED = frozenset(getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA", "EAI_FAIL", "EAI_ADDRFAMILY")
                          if hasattr(socket, name))


def _where() -> str:
    return f"MASTER_ADDR={os.environ.get('MASTER_ADDR', '')!r}, MASTER_PORT={os.environ.get('MASTER_PORT', '')!r}"


#: What to check, said by every refusal of the rendezvous address.
_CHECK = ("check that MASTER_ADDR names the host of rank 0 as this machine reaches it and MASTER_PORT a free "
          "port there that the other machines can reach (torchrun sets both from --master-addr and "
          "--master-port, or --rdzv-endpoint)")


def _check_rendezvous_address() -> None:
    """Refuse (:class:`RendezvousError`) a ``MASTER_PORT`` that is not a port, or a ``MASTER_ADDR`` that
    does not resolve, before torch tries them: torch retries a name that does not resolve until its
    store's timeout (30 minutes), warning every second, then ends in a traceback. Unset, they are left
    to torch (its one line names the variable)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    # 0 is no port to meet at: rank 0's store would bind any free one, which the others cannot know
    if port is not None and not (port.strip().isascii() and port.strip().isdigit() and 1 <= int(port) <= 65535):
        raise RendezvousError(f"{_where()}: MASTER_PORT is not a port number (1 to 65535); {_CHECK}")
    if not addr:
        return
    try:
        socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno in _NOT_RESOLVED:
            raise RendezvousError(f"{_where()}: the host name MASTER_ADDR does not resolve ({err.strerror}); "
                                  f"{_CHECK}") from None
    except UnicodeError as err:  # not a host name (the idna codec: a label empty or past 63 characters)
        why = re.search(r"UnicodeError: (.+)\)$", str(err))
        raise RendezvousError(f"{_where()}: the host name MASTER_ADDR does not resolve (not a host name: "
                              f"{why.group(1) if why else err}); {_CHECK}") from None
    except OSError:  # left to torch
        pass


def _rendezvous_at() -> str:
    """``MASTER_ADDR:MASTER_PORT`` as one address; an IPv6 host (it holds a colon) in brackets, as in a
    URL, so that the port reads apart from it: ``[::1]:29521``, not ``::1:29521``."""
    host, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _joining_failed(err: BaseException) -> RendezvousError:
    """torch's failure to join (a :class:`torch.distributed.DistError`: the port taken, the store not
    reached in time) as one line naming the address and what to check; its first line kept."""
    first = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return RendezvousError(f"{_where()}: joining the process group failed ({first}); {_CHECK}")


#: What torch raises where the group cannot be joined (its store's network errors and timeouts).
_DIST_ERROR = getattr(dist, "DistError", RuntimeError)


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
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1): NCCL on GPUs, gloo on CPUs.

    The group forms once every rank has joined. torch waits for them in C++ (30 minutes by default),
    where the main thread handles no signal: SIGTERM and Ctrl-C would do nothing meanwhile. So, on
    CPUs (gloo), the joining runs on a helper thread, which the main thread waits for in Python — a
    signal then ends the command as anywhere else — and for at most ``OSDN_DIAG_RENDEZVOUS_TIMEOUT``
    seconds (:func:`rendezvous_timeout`); a group not formed by then is refused
    (:class:`TimeoutError`, one line: the other ranks never came, e.g. ``WORLD_SIZE`` set by hand for
    one process). On GPUs (NCCL) the calling thread joins, under torch's own timeout: CUDA's current
    device is a thread's own, and NCCL's communicators are bound to the device of the thread that
    makes them. Either way a ``MASTER_ADDR`` that does not resolve or a ``MASTER_PORT`` that is not a
    port is refused first, and torch's failure to join (the port taken, its store not reached) is
    one line naming both (:class:`RendezvousError`), not torch's traceback."""
    world = launched_world()
    if world > 1 and not dist.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", 0))
        limit = rendezvous_timeout()
        _check_rendezvous_address()
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            try:
                dist.init_process_group(backend="nccl")
            except _DIST_ERROR as err:
                raise _joining_failed(err) from err
            return current()
        failed = []

        def join() -> None:
            try:
                dist.init_process_group(backend="gloo")
            except BaseException as err:  # raised in the caller's thread
                failed.append(err)

        helper = threading.Thread(target=join, name="osdn-diag-rendezvous", daemon=True)
        helper.start()
        helper.join(limit)  # interrupted by a signal's handler (SIGTERM, Ctrl-C) like any wait in Python
        if helper.is_alive():
            where = _rendezvous_at()
            raise TimeoutError(
                f"WORLD_SIZE={world}: the other processes of the group did not join within {limit:g} s "
                f"(rendezvous at {where}); start every rank with torchrun, or unset WORLD_SIZE to run one "
                f"process ({RENDEZVOUS_ENV} sets the wait); if they were started, check MASTER_ADDR and "
                "MASTER_PORT: rank 0's host as every machine reaches it, and a port open there")
        if failed:
            if isinstance(failed[0], _DIST_ERROR):
                raise _joining_failed(failed[0]) from failed[0]
            raise failed[0]
    return current()


def rendezvous_timeout() -> float:
    """How long :func:`init_from_env` waits for the other ranks: ``OSDN_DIAG_RENDEZVOUS_TIMEOUT``
    seconds if set, else :data:`RENDEZVOUS_TIMEOUT`. A value that is not a number above 0 and at most
    :data:`RENDEZVOUS_MAX` (a week: a thread's wait takes no deadline past the platform's clock range)
    is refused (:class:`ValueError` naming the variable)."""
    raw = os.environ.get(RENDEZVOUS_ENV)
    if raw is None:
        return RENDEZVOUS_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 < value <= RENDEZVOUS_MAX):
        raise ValueError(f"{RENDEZVOUS_ENV}={raw!r}: expected the seconds to wait for the other ranks, "
                         f"a number above 0 and at most {RENDEZVOUS_MAX:g}")
    return value


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
