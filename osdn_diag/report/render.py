"""Drawing the report's figures, each as PNG and PDF: in this process, or in worker processes.

A figure is described by a :class:`Figure` — the name of a function of :mod:`.plots`, its
arguments and the PNG's path — so that a worker process can draw it from the description alone.
:func:`draw` writes every figure it is given; inside a :func:`figure_workers` block it hands each
file (every PNG and every PDF separately) to that block's workers at once (with a single worker it
draws every second file itself meanwhile), else it draws them one after another here. The files are the same either way: each is drawn by the same function from the
same arguments on a figure of its own (a PDF saved after a PNG of the same figure gets a bounding
box a few hundredths of a point different) and written through a temporary file and a rename.

Why workers: matplotlib draws a figure four times to save it as PNG and PDF with a tight bounding
box, one figure after another, and a first figure also waits for matplotlib's import and its font
and mathtext caches. The report of the paper-scale run spent 2–3 s there on an H200 host, all of it
on one core. The command line starts the workers when a command that ends in a report starts, so
that their imports overlap the model's work, and the figures are then drawn side by side.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..rundir import PLOT_FILES
from ..runtime.cpus import usable_cpus
from . import plots

__all__ = ["Figure", "default_workers", "draw", "figure_workers", "WORKERS_ENV"]

#: The environment variable that sets how many processes draw the report's figures.
WORKERS_ENV = "OSDN_DIAG_REPORT_WORKERS"
#: At most this many workers by default: a report has at most 7 figures, 14 files.
MAX_WORKERS = 8
#: At most this many workers whatever ``OSDN_DIAG_REPORT_WORKERS`` says: one per file a report draws
#: (more would have nothing to draw, and each costs a process and its imports).
MAX_ASKED = len(PLOT_FILES)

_workers = None  # the executor of the innermost active figure_workers block
_worker_count = 0  # and how many processes it has


@dataclass(frozen=True)
class Figure:
    """One figure of a report: ``getattr(plots, plot)(*args)`` saved to ``path`` (PNG) and to
    ``path.with_suffix(".pdf")``. The arguments must be picklable (summaries, lists, numpy arrays)."""

    plot: str
    args: tuple
    path: Path

    def targets(self) -> tuple[Path, Path]:
        return self.path, self.path.with_suffix(".pdf")


def default_workers() -> int:
    """How many worker processes :func:`figure_workers` starts when not told: ``OSDN_DIAG_REPORT_WORKERS``
    if set (0: none, the figures are drawn in the calling process; at most :data:`MAX_ASKED`, one per
    file a report draws), else the CPUs this process may
    run on less two (the command's own threads), at most 8, and one where there are two or three
    CPUs: the command then draws every second file itself (:func:`draw`), and on the CPU its run takes
    one core (one torch thread), so the worker imports matplotlib beside the run and then halves the
    drawing (the demo on a 2-core CPU: 21.8 s without it, 20.5 s with it). None with one CPU."""
    raw = os.environ.get(WORKERS_ENV)
    if raw is not None:
        try:
            n = int(raw)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"{WORKERS_ENV}={raw!r}: expected a whole number of processes, 0 or more "
                             "(0: the report's figures are drawn in the command's own process)")
        return min(n, MAX_ASKED)
    cpus = usable_cpus()
    return 0 if cpus < 2 else min(MAX_WORKERS, max(1, cpus - 2))


def _prepare() -> None:
    """A worker's start: import matplotlib and draw a small figure with text and mathtext to PNG and
    PDF in memory, so that fonts and the mathtext parser are loaded before the first real figure.
    Ctrl-C is the parent's to handle (it stops the workers): a worker ignores it. A worker whose
    parent is gone — killed, say, so that it never stopped its workers — exits: waiting for work, it
    would not notice (it holds its queue's other end itself)."""
    import io
    import multiprocessing
    import signal
    import threading

    from ..runtime.bytecode import keep_bytecode

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_bytecode()  # as the command's own process does: matplotlib compiled once, not at every start
    parent = multiprocessing.parent_process()
    if parent is not None:
        def orphaned() -> None:
            parent.join()  # returns when the parent process has ended
            os._exit(0)

        threading.Thread(target=orphaned, name="parent-watch", daemon=True).start()
    fig = plots._figure((2, 1))
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], label="x")
    ax.set_title(r"$q_{geo}$ warm-up")
    ax.legend()
    for fmt in ("png", "pdf"):
        fig.savefig(io.BytesIO(), format=fmt, dpi=72, bbox_inches="tight")


def _ready() -> bool:
    return True


def _draw_file(plot: str, args: tuple, target: str) -> set[str]:
    """Draw one figure and write one of its files (the format from ``target``'s suffix), here or in a
    worker; returns the characters of its labels that no installed font has (:func:`plots.label_fonts`)."""
    missing: set[str] = set()
    with plots.label_fonts(missing):
        plots.save_as(getattr(plots, plot)(*args), Path(target))
    return missing


@contextlib.contextmanager
def figure_workers(n: int | None = None):
    """Within this block :func:`draw` draws on ``n`` worker processes (default
    :func:`default_workers`), started now — each imports matplotlib and primes its caches while the
    caller goes on — and stopped when the block ends. With ``n < 1``, inside another such block, or
    where worker processes cannot be started, nothing is started and the figures are drawn as
    without it."""
    global _workers, _worker_count
    n = default_workers() if n is None else n
    pool = _start(n) if n >= 1 and _workers is None else None
    if pool is None:
        yield
        return
    _workers, _worker_count = pool, n
    try:
        yield
    finally:
        _stop_workers()  # where a failed draw has not already


def _start(n: int):
    """``n`` worker processes, all started now; ``None`` if they cannot be started."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # "spawn": a fresh interpreter that never imports torch — not a fork of a process that holds a
    # CUDA context and running threads.
    pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"), initializer=_prepare)
    try:
        with _sigint_ignored():  # inherited: a Ctrl-C while a worker starts up is the parent's alone
            for _ in range(n):  # the pool starts a process per task waiting for one: all n start now
                pool.submit(_ready)
    except OSError:  # no process could be started (a sandbox, a limit on processes): draw here
        pool.shutdown(wait=True, cancel_futures=True)  # and stop those that did start
        return None
    return pool


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored in this process while the block runs (on the main thread only, where Python
    handles signals), so that processes started in it begin with SIGINT ignored."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _stop_workers() -> None:
    """Shut the active workers down (what they have not started is cancelled, what they draw is waited
    for); the rest of the :func:`figure_workers` block draws here."""
    global _workers, _worker_count
    pool, _workers, _worker_count = _workers, None, 0
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def draw(figures: list[Figure]) -> None:
    """Write every figure's PNG and PDF (on the active :func:`figure_workers`, with a single worker
    also here, side by side; else here, in order). An error drawing one figure is raised as it would be here; if the worker
    processes themselves fail (killed, say), their files are drawn here instead."""
    missing: set[str] = set()
    _draw_jobs([(f.plot, f.args, str(t)) for f in figures for t in f.targets()], missing)
    if missing:  # once for the report, not once per file
        import sys

        print(plots.missing_glyphs_note(missing), file=sys.stderr)


def _draw_jobs(jobs: list[tuple], missing: set[str]) -> None:
    """Write the files ``jobs`` (``(plot, args, target)`` each) as :func:`draw` says, adding to
    ``missing`` the characters no installed font has."""
    left = range(len(jobs))
    if _workers is not None:
        from concurrent.futures.process import BrokenProcessPool

        # With one worker (two or three CPUs) this process draws every second file meanwhile, which
        # halves the time. With more, the workers draw them all: a share here would first import
        # matplotlib and load its fonts in this process (0.5 s or more), which the workers did while
        # the model ran, to save a fraction of one file's drawing.
        here = [i for i in left if i % 2] if _worker_count == 1 else []
        futures, done = [], set()
        try:
            futures = [_workers.submit(_draw_file, *jobs[i]) for i in left if i not in here]
            for i in here:
                missing |= _draw_file(*jobs[i])
                done.add(i)
            for future in futures:
                missing |= future.result()
            return
        except BrokenProcessPool:
            left = [i for i in left if i not in done]  # written again below, each through a temporary file
        except BaseException:
            # A figure failed (or Ctrl-C, SIGTERM): nothing is written after this returns, as when drawn
            # here. The pool is shut down: its own thread cancels what no worker has started, and this
            # waits for what they have (or for the pool to break, where they were killed too). Never by
            # cancelling the futures from here: when a worker then dies (a SIGTERM to the whole process
            # group), the executor's thread fails the pending futures one by one, stops with an
            # InvalidStateError at the first one cancelled here (CPython 3.11), and leaves the running
            # ones unresolved, so that waiting for them never returned.
            _stop_workers()
            raise
    for i in left:
        missing |= _draw_file(*jobs[i])
