"""SIGTERM and SIGINT held back while a step that must not be cut short runs, and delivered as soon as
it ends.

The console script turns both signals into an exception (KeyboardInterrupt, or its subclass for
SIGTERM) raised wherever the main thread is: the command's clean-up then runs as on Ctrl-C. Two
places must not see it:

* the import of a library with compiled extensions (torch, triton, transformers and what they load):
  pybind11 and pyo3 call back into Python while a module loads, and an exception raised there by a
  signal handler can end the process in C++'s ``std::terminate`` (an abort, the lock left behind)
  instead of the import. :func:`hold_signals_during_imports` holds the signals over every such
  import the command makes, wherever in the command it happens;
* a step that takes a file tree from one consistent state to the next (``merge`` putting the merged
  run in the place of the old one), through :func:`signals_held`.

Held means blocked in the main thread (``pthread_sigmask``), so that the kernel keeps the signal
pending, and, since a thread the process started earlier may still take it (Python then runs the
handler in the main thread all the same), the handlers replaced by one that records it. When the
step ends the handlers come back, the mask is lifted and the signal is delivered: the usual handler
raises, after the step. Only the main thread handles signals in Python: elsewhere nothing changes.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["HEAVY", "hold_signals_during_imports", "signals_held"]

#: The signals held back: Ctrl-C and ``kill`` (a batch system preempting or cancelling the job).
SIGNALS = (signal.SIGTERM, signal.SIGINT)

#: The top-level packages whose import (any of their modules, and everything that import imports)
#: is held from the signals: compiled extensions that call back into Python as they load, and the
#: libraries that import them.
HEAVY = frozenset({"torch", "triton", "transformers", "fla", "safetensors", "tokenizers", "pyarrow", "pandas",
                   "numpy", "scipy", "sympy", "matplotlib", "PIL", "accelerate", "huggingface_hub", "plotly"})

_depth = 0  # how many signals_held blocks the main thread is in


@contextmanager
def signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT held back while the block runs (see the module docstring), then delivered:
    a signal that came meanwhile is raised by its handler as the block ends, after it. Nested blocks
    hold them once, until the outermost ends. A signal whose disposition is not a Python handler
    (ignored, or the default) is blocked only: ignored it stays ignored, and the default ends the
    process when the block ends, as it would have at once."""
    global _depth
    if _depth or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    caught: list[int] = []

    def record(signum, frame):
        caught.append(signum)

    previous = {}
    for signum in SIGNALS:
        handler = signal.getsignal(signum)
        if callable(handler):
            previous[signum] = signal.signal(signum, record)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        _restore(previous, record)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal kept pending is handled here
        for signum in dict.fromkeys(caught):  # one a thread of ours took meanwhile
            signal.raise_signal(signum)


def _restore(previous: dict, record) -> None:
    """Put the handlers back. ``signal.signal`` first runs the handlers of signals that came: one
    already put back may raise, and the others must still be put back (else a later Ctrl-C would only
    be recorded); the first such exception is raised once all are."""
    raised = None
    for signum, handler in previous.items():
        while signal.getsignal(signum) is record:
            try:
                signal.signal(signum, handler)
            except BaseException as err:  # noqa: BLE001 - the handler's KeyboardInterrupt, re-raised below
                raised = raised or err
    if raised is not None:
        raise raised


class _HeldLoader:
    """A module's loader that executes it with the signals held (:func:`signals_held`). It puts the
    real loader back in the module's ``__loader__`` and ``__spec__`` before the module's own code runs,
    so that nothing but the import itself ever sees it."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        with signals_held():  # an extension module is initialised here
            return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        with signals_held():
            self.loader.exec_module(module)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)


class _HoldDuringImport:
    """A finder first on ``sys.meta_path`` that finds a module of :data:`HEAVY` through the finders after
    it and hands the import system its spec with a :class:`_HeldLoader`. The imports it makes are held
    with it (only the outermost is wrapped); those of other threads are left alone."""

    def find_spec(self, name, path=None, target=None):
        if (name.partition(".")[0] not in HEAVY or _depth
                or threading.current_thread() is not threading.main_thread()):
            return None
        try:
            after = sys.meta_path[sys.meta_path.index(self) + 1:]
        except ValueError:
            return None
        for finder in after:
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module") and hasattr(spec.loader, "create_module"):
            spec.loader = _HeldLoader(spec.loader)
        return spec


@contextmanager
def hold_signals_during_imports() -> Iterator[None]:
    """While the block runs, every import of a module of :data:`HEAVY` in the main thread holds
    SIGTERM and SIGINT back until it has finished (see the module docstring)."""
    finder = _HoldDuringImport()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        try:
            sys.meta_path.remove(finder)
        except ValueError:
            pass
