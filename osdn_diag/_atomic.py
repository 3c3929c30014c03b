"""Files written all at once or not at all: a temporary file beside the target, renamed into place
only when the writing succeeded (a crash never leaves a file that looks complete).

The file gets the mode ``open(path, "w")`` would give it, ``0o666 & ~umask`` (usually 0644), so that
a run directory shared with colleagues stays readable to them: the temporary is created with it
(``tempfile.mkstemp`` would make it 0600), and it is set again once the writer has finished, just
before the rename, because some writers replace the temporary with a file of their own (safetensors'
``save_file`` writes a 0600 file and renames it over the path it was given). It is flushed to disk before the rename and the directory
after it, so that after a power loss the name points at the whole file or at the old one. A writer
killed before the rename (SIGKILL, out of memory) leaves its temporary, ``.NAME.XXXXXXXX.tmp``;
:func:`remove_stale_temporaries` removes those where a run directory is opened for writing again.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_text", "remove_stale_temporaries"]

# `.NAME.` + 8 random characters + `.tmp`: what atomic_path creates (hex), and what tempfile.mkstemp
# created in earlier versions ([a-z0-9_]).
_STALE = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")


def _create_temporary(directory: Path, name: str, suffix: str) -> Path:
    """A new empty file ``directory/.name.XXXXXXXX{suffix}``, created exclusively with mode 0o666 (which
    the umask reduces, as for any ``open()``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = directory / f".{name}.{secrets.token_hex(4)}{suffix}"
        try:
            os.close(os.open(tmp, flags, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name for {directory / name}")


def _fsync(path: Path, *, directory: bool = False) -> None:
    """Flush ``path`` to disk. For a directory (its new entry) best effort: some platforms and file
    systems cannot open or sync one, and the file itself is complete either way."""
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path in ``path``'s directory (created if needed) to write to; it becomes
    ``path`` when the block ends without an error and is removed otherwise. ``suffix`` for writers
    that read the format from the extension. The file must be closed when the block ends."""
    path = Path(path)
    with _naming_full_disk(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _create_temporary(path.parent, path.name, suffix)
        mode = stat.S_IMODE(os.stat(tmp).st_mode)  # 0o666 & ~umask, without changing the process umask
        try:
            yield str(tmp)
            os.chmod(tmp, mode)
            _fsync(tmp)
            os.replace(tmp, path)
            _fsync(path.parent, directory=True)
        finally:
            tmp.unlink(missing_ok=True)


@contextmanager
def _naming_full_disk(path: Path) -> Iterator[None]:
    """A full disk, quota or read-only file system while ``path`` is written, whatever the writer made
    of it (an OSError without a file name, a RuntimeError or AttributeError around it), raised as a
    :class:`~osdn_diag._storage.StorageError` naming ``path``."""
    from ._storage import as_storage_error

    try:
        yield
    except Exception as err:
        full = as_storage_error(err, path)
        if full is None or full is err:
            raise
        raise full from err


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    with atomic_path(path) as tmp, open(tmp, "w") as fh:
        fh.write(text)


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporaries (``.NAME.XXXXXXXX.tmp``) that :func:`atomic_path` writers killed before
    their rename left in ``directory`` (not in its subdirectories); return their paths.

    Only for a directory no other process is writing into at the time: a live writer's temporary
    looks the same. A missing directory has none."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
        if _STALE.fullmatch(entry.name) and entry.is_file() and not entry.is_symlink():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
