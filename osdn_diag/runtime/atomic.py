"""Files written all at once or not at all: a temporary file beside the target, renamed into place
only when the writing succeeded (a crash never leaves a file that looks complete).

The file gets the mode ``open(path, "w")`` would give it, ``0o666 & ~umask`` (usually 0644), so that
a run directory shared with colleagues stays readable to them: the temporary is created with it
(``tempfile.mkstemp`` would make it 0600), and it is set again once the writer has finished, just
before the rename, because some writers replace the temporary with a file of their own (safetensors'
``save_file`` writes a 0600 file and renames it over the path it was given). It is flushed to disk before the rename and the directory
after it, so that after a power loss the name points at the whole file or at the old one. A writer
killed before the rename (SIGKILL, out of memory) leaves its temporary, ``.NAME.XXXXXXXX.tmp``
(``.NAME.XXXXXXXX.tmp.EXT`` for a writer that reads the format from the extension): one pattern, which
:func:`remove_stale_temporaries` removes where a run directory is opened for writing again.

Links: a file is written by renaming a new temporary over its name, so a link at that name would be
replaced, never written through; with ``root`` (the directory a command writes into),
:func:`atomic_path` refuses a link at the name or at any directory between ``root`` and it
(:class:`LinkError`), since a link the package did not create is the user's: replacing or following it
would change a file outside the run.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["LinkError", "NotAFileError", "atomic_path", "atomic_write_text", "fsync_directory", "is_temporary",
           "real_directory", "refuse_link", "refuse_special", "remove_stale_temporaries"]

# `.NAME.` + 8 random characters + `.tmp`, then the writer's extension if it needs one: what
# atomic_path creates (hex), and what tempfile.mkstemp created in earlier versions ([a-z0-9_]).
# Earlier versions also named a figure's temporary `.NAME.png.XXXXXXXX.png` (or .pdf): matched too, so
# that those a killed report left go as well.
_STALE = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp(\.[A-Za-z0-9]{1,10})?|\..+\.(png|pdf)\.[0-9a-f]{8}\.(png|pdf)")


def is_temporary(name: str) -> bool:
    """Whether ``name`` is that of a temporary :func:`atomic_path` creates (or an earlier version did)."""
    return _STALE.fullmatch(name) is not None


class LinkError(ValueError):
    """A symbolic link where the package would write: refused, never followed nor replaced."""


def refuse_link(path: str | os.PathLike) -> None:
    """Raise :class:`LinkError` if ``path`` is a symbolic link (dangling or not)."""
    if os.path.islink(path):
        raise LinkError(f"{path}: a symbolic link, where osdn-diag writes; it never writes through a link "
                        "nor replaces one: remove the link (its target is left alone), or choose another --out")


class NotAFileError(ValueError):
    """A FIFO, a device or a socket (or a link to one) where the package would write a file."""


def refuse_special(path: str | os.PathLike) -> None:
    """Raise :class:`NotAFileError` if ``path`` is, or links to, something that is neither a regular
    file nor a directory — a FIFO, a device (``/dev/null``), a socket, ``/dev/stdout`` —: the file is
    written by renaming a temporary over its name, which would put a regular file in the place of the
    device (as root, of ``/dev/null`` itself) instead of writing to it."""
    for stat_of in (os.lstat, os.stat):  # the name itself, and what a link there points to
        try:
            mode = stat_of(path).st_mode
        except (FileNotFoundError, NotADirectoryError):  # nothing there (or a dangling link): fine
            return
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            raise NotAFileError(f"{path}: not a regular file (a FIFO, a device, a socket or a link to one), where "
                                "osdn-diag writes a file; it is left alone: give the path of a file")


def check_target(path: str | os.PathLike) -> None:
    """Refuse ``path`` as the name of a file to write by a rename: a FIFO, a device or a socket (never
    replaced, :func:`refuse_special`) or a directory (the rename would fail after the work, as a raw
    Errno 21). Writers that check all their files before they start (the report) call it first."""
    refuse_special(path)
    if os.path.isdir(path) and not os.path.islink(path):
        raise IsADirectoryError(f"{path}: a directory, where osdn-diag writes a file; move it away, or "
                                "choose another --out")


def real_directory(root: str | os.PathLike, directory: str | os.PathLike) -> Path:
    """``directory`` (``root`` or below it), created where missing, each directory from ``root`` down
    a real one: a link on the way is refused (:class:`LinkError`), so that nothing written below it
    lands outside ``root``. ``root`` itself is the caller's (a ``--out`` may well be a link)."""
    root, directory = Path(root), Path(directory)
    rel = directory.relative_to(root)
    root.mkdir(parents=True, exist_ok=True)
    if ".." in rel.parts:
        raise ValueError(f"{directory}: not below {root}")
    current = root
    for part in rel.parts:
        current = current / part
        refuse_link(current)
        try:
            current.mkdir()
        except FileExistsError:
            if not current.is_dir():
                raise NotADirectoryError(f"{current}: not a directory, where osdn-diag writes one; remove "
                                         "it, or choose another --out") from None
    return directory


def _create_temporary(directory: Path, name: str, suffix: str) -> Path:
    """A new empty file ``directory/.name.XXXXXXXX{suffix}``, created exclusively with mode 0o666 (which
    the umask reduces, as for any ``open()``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    tail = ".tmp" + ("" if suffix == ".tmp" else suffix)  # every temporary matches _STALE
    for _ in range(100):
        tmp = directory / f".{name}.{secrets.token_hex(4)}{tail}"
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


def fsync_directory(path: str | os.PathLike) -> None:
    """Flush ``path``'s entries (files renamed into it) to disk, where the platform can."""
    _fsync(Path(path), directory=True)


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp", *, root: str | os.PathLike | None = None
                ) -> Iterator[str]:
    """Yield a temporary path in ``path``'s directory (created if needed) to write to; it becomes
    ``path`` when the block ends without an error and is removed otherwise. ``suffix`` for writers
    that read the format from the extension. The file must be closed when the block ends.

    ``root``: the directory the command writes into; ``path`` and every directory between ``root`` and
    it must not be a link (:func:`real_directory`, :func:`refuse_link`)."""
    path = Path(path)
    with _naming_full_disk(path):
        if root is None:
            path.parent.mkdir(parents=True, exist_ok=True)
        else:
            real_directory(root, path.parent)
            refuse_link(path)
        check_target(path)
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
    :class:`~osdn_diag.runtime.storage.StorageError` naming ``path``."""
    from .storage import as_storage_error

    try:
        yield
    except Exception as err:
        full = as_storage_error(err, path)
        if full is None or full is err:
            raise
        raise full from err


def atomic_write_text(path: str | os.PathLike, text: str, *, root: str | os.PathLike | None = None) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename
    (``root`` as for :func:`atomic_path`)."""
    with atomic_path(path, root=root) as tmp, open(tmp, "w") as fh:
        fh.write(text)


def remove_stale_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Remove the temporaries (``.NAME.XXXXXXXX.tmp[.EXT]``) that :func:`atomic_path` writers killed
    before their rename left in ``directory`` (not in its subdirectories); return their paths.

    Only for a directory no other process is writing into at the time: a live writer's temporary
    looks the same. A missing directory has none, and so has a link (what it points to is not ours)."""
    directory = Path(directory)
    if directory.is_symlink() or not directory.is_dir():
        return []
    removed = []
    for entry in directory.iterdir():
        if is_temporary(entry.name) and entry.is_file() and not entry.is_symlink():
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
