"""How the console script ends: one line and an exit status for the user's errors, Ctrl-C and SIGTERM,
a reader that leaves the pipe, and a fast exit that leaves the interpreter's teardown to the
operating system."""

from __future__ import annotations

import contextlib
import os
import sys

from .dispatch import _user_errors, main


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a batch system preempting or cancelling a job), raised where Ctrl-C would be:
    a subclass of KeyboardInterrupt, so that every clean-up that runs on Ctrl-C runs on it too (a
    temporary removed, a replay's stages put back, the lock released) and the files stay consistent."""


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM raises :class:`Terminated` in the main thread while the block runs (the previous
    handler is restored after it); elsewhere, where Python cannot handle signals, nothing changes."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _ReaderMayLeave:
    """Standard output whose reader may go away (``osdn-diag run … | head``): the first write to a
    closed pipe sends the rest of the output to /dev/null, and the command goes on to its end (its
    files complete, its exit status its own), where a plain stream would raise BrokenPipeError in
    whatever line was printing, ending a finished run in an error."""

    def __init__(self, stream):
        self._stream = stream

    def _gone(self) -> None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no file descriptor (a StringIO): drop the output
            import io

            self._stream = io.StringIO()

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _reader_may_leave():
    """:class:`_ReaderMayLeave` as ``sys.stdout`` while the block runs."""
    previous = sys.stdout
    sys.stdout = _ReaderMayLeave(previous)
    try:
        yield
    finally:
        try:
            sys.stdout.flush()
        except OSError:
            # Not a reader that left (the wrapper takes those) but a full disk, say: the text stays
            # buffered and the final flush reports it as a normal exit does (status 120), not as an
            # error of the command's own.
            pass
        finally:
            sys.stdout = previous


def entry(argv: list[str] | None = None) -> int:
    """The console script: like :func:`main`, but an error about the user's input (a file, a layer,
    an argument) is printed as one line and exits with status 2, Ctrl-C exits with status 130 and
    SIGTERM with 143 (128 + the signal's number, as a shell reports it), each after one line;
    ``--debug`` (or ``OSDN_DIAG_DEBUG=1``) shows the traceback instead."""
    import os

    from ..runtime.bytecode import keep_bytecode
    from ..runtime.signals import hold_signals_during_imports

    keep_bytecode()  # a process of its own: PYTHONDONTWRITEBYTECODE no longer recompiles torch each time
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("OSDN_DIAG_DEBUG") == "1"
    try:
        # A signal that comes while torch and the like are imported waits for the import's end: one
        # raised inside it could abort the process (pybind11's std::terminate), lock left behind.
        with _sigterm_as_interrupt(), hold_signals_during_imports(), _reader_may_leave():
            return main(argv, report_workers=True)
    except SystemExit as done:  # argparse: --help, or a usage error it has printed on one line
        if isinstance(done.code, int) or done.code is None:
            return done.code or 0
        # A message (sys.exit("...")): the user's error, on one line like the others.
        print(f"osdn-diag: error: {' '.join(str(done.code).split())}", file=sys.stderr)
        return 2
    except Terminated:
        if debug:
            raise
        print("osdn-diag: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        if debug:
            raise
        print("osdn-diag: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        user_error = _as_user_error(err)
        if user_error is None or debug:
            raise
        print(f"osdn-diag: error: {' '.join(str(user_error).split())} (--debug shows the traceback)",
              file=sys.stderr)
        return 2


def _as_user_error(err: Exception) -> Exception | None:
    """``err`` if it describes the user's input (:func:`_user_errors`); a full disk, quota or read-only
    file system anywhere in its chain (a writer's RuntimeError around it, say) as a
    :class:`~osdn_diag.runtime.storage.StorageError`; else ``None``: a fault of this package, shown as a
    traceback."""
    from ..runtime.storage import StorageError, storage_error

    cause = storage_error(err)
    if cause is not None and not isinstance(err, StorageError):
        return StorageError(cause.errno, cause.strerror or os.strerror(cause.errno),
                            cause.filename or "the output directory")
    return err if isinstance(err, _user_errors()) else None


def console() -> None:
    """The ``osdn-diag`` console script and ``python -m osdn_diag``: :func:`entry`, then the process
    ends without tearing the interpreter down. Exit handlers run and the output streams are flushed
    as at a normal exit, but freeing every module and object of torch, transformers and fla one by
    one, which only the exit itself would wait for, is left to the operating system: 1.5 s of a small
    CPU run (docs/performance.md). ``OSDN_DIAG_FAST_EXIT=0`` exits the usual way; so does a process
    that still has a non-daemon thread running, which a normal exit waits for."""
    import os

    code = entry()
    import atexit
    import threading

    waiting = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if os.environ.get("OSDN_DIAG_FAST_EXIT", "1") == "0" or waiting:
        sys.exit(code)
    atexit._run_exitfuncs()  # logging, multiprocessing, weakref.finalize (temporary directories), ...
    code = 0 if code is None else code if isinstance(code, int) else 1  # as sys.exit(code) would
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a closed reader or stream: nothing to deliver to
            pass
        except OSError as err:  # a full disk, say: as a normal exit does, say so and fail
            try:
                print(f"osdn-diag: error: writing the output failed: {err}", file=sys.stderr, flush=True)
            except (OSError, ValueError):
                pass
            code = code or 120
    try:  # what native libraries (CUDA, NCCL) have buffered in C's stdio
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code)
