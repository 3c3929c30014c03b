"""A full disk (or quota, or read-only file system) said in one line naming the file.

Writers fail on a full disk in their own ways: pyarrow's ``OSError`` with no file name, wrapped by the
table writer's thread in a RuntimeError; matplotlib's PDF backend in an AttributeError raised while it
handles the ``OSError``; ``os.write`` with no file name at all; safetensors (Rust) a ``SafetensorError``,
no ``OSError`` at all, whose message ends in Rust's ``(os error 28)``. The run's state stays correct (every
file goes through a temporary and a rename, :mod:`osdn_diag.runtime.atomic`), but the message named no path
or came as a traceback. :func:`storage_error` finds the ``OSError`` in an exception's chain, and
:class:`StorageError` says which file could not be written and what to do.
"""

from __future__ import annotations

import errno
import os
import re

__all__ = ["STORAGE_ERRNOS", "StorageError", "storage_error"]

#: The errors that mean "this file system cannot take the file" rather than a fault of the writer.
STORAGE_ERRNOS = frozenset(code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EROFS,
                                             errno.EFBIG) if code is not None)


class StorageError(OSError):
    """Writing ``filename`` failed because its file system is full, over quota or read-only. Built as
    ``StorageError(errno, strerror, filename)`` (so that it pickles across processes like an OSError)."""

    def __str__(self) -> str:
        return f"{self.filename}: writing failed ({self.strerror}); free space there or choose another --out"


#: How Rust's ``std::io::Error`` ends its message (safetensors' ``SafetensorError`` carries no errno).
_RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)\s*$")


def storage_error(err: BaseException | None) -> OSError | None:
    """The ``OSError`` of :data:`STORAGE_ERRNOS` in ``err``'s chain (itself, its cause or context, …),
    else ``None``. An error of a Rust library (safetensors) whose message ends in ``(os error N)`` of
    those codes counts as that ``OSError`` (without a file name)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in STORAGE_ERRNOS:
            return err
        rust = None if isinstance(err, OSError) else _RUST_IO_ERROR.search(str(err))
        if rust and int(rust.group(1)) in STORAGE_ERRNOS:
            code = int(rust.group(1))
            return OSError(code, os.strerror(code))
        err = err.__cause__ or err.__context__
    return None


def as_storage_error(err: BaseException, path) -> StorageError | None:
    """``err`` as a :class:`StorageError` naming ``path`` when a full disk caused it, else ``None``."""
    if isinstance(err, StorageError):
        return err
    cause = storage_error(err)
    if cause is None:
        return None
    return StorageError(cause.errno, os.strerror(cause.errno), os.fspath(path))
