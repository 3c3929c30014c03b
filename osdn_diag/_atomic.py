"""Files written all at once or not at all: a temporary file beside the target, renamed into place
only when the writing succeeded (a crash never leaves a file that looks complete)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "atomic_write_text"]


@contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path in ``path``'s directory (created if needed) to write to; it becomes
    ``path`` when the block ends without an error and is removed otherwise. ``suffix`` for writers
    that read the format from the extension."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    with atomic_path(path) as tmp, open(tmp, "w") as fh:
        fh.write(text)
