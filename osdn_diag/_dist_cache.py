"""``importlib.metadata.packages_distributions()``, remembered between processes.

transformers before 5.24 calls it while it is being imported (``transformers.utils.import_utils`` builds a
module-level mapping from it). It reads the metadata of every installed distribution, and the whole
file list (``RECORD``) of each one without a ``top_level.txt``: on one H200 host, with transformers
5.17, that was 1.57 s of every command (cProfile; ``benchmarks/RESULTS.md``, "Wall clock").

:func:`remember_distributions` answers it from a file in the osdn-diag cache instead
(``$XDG_CACHE_HOME/osdn-diag/distributions.json``, else ``~/.cache/osdn-diag/distributions.json``),
kept under a key of what is installed: every ``sys.path`` folder with its modification time and its
``*.dist-info`` / ``*.egg-info`` entries with theirs. Installing, removing or upgrading a package adds
or removes an entry, so the folder's time and the list both change, and the mapping is computed again
(and the file rewritten, atomically; it keeps the :data:`KEEP` latest keys, as the working
directory, on ``sys.path`` for ``python -m``, is part of the key). Reading the key costs one directory listing per ``sys.path``
folder. Only ``packages_distributions`` is replaced, and only until :func:`forget_distributions`; a
cache that cannot be read or written is ignored. ``OSDN_DIAG_DIST_CACHE=off`` leaves the function
alone; ``OSDN_DIAG_DIST_CACHE=FILE`` keeps the mapping in ``FILE``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path

from ._cache_paths import cache_path

__all__ = ["ENV", "cache_file", "distributions_key", "forget_distributions", "remember_distributions"]

ENV = "OSDN_DIAG_DIST_CACHE"
#: The standard library's own function, called where the cache cannot answer.
_COMPUTE = importlib.metadata.packages_distributions


def cache_file() -> Path | None:
    """Where the mapping is kept, or ``None`` if ``OSDN_DIAG_DIST_CACHE`` is off."""
    return cache_path(ENV, "distributions.json")


def distributions_key() -> str:
    """A digest of what ``packages_distributions`` reads: each ``sys.path`` entry (a folder with its
    modification time and its metadata folders with theirs, or a file with its time and size)."""
    parts: list = [sys.version, sys.path]
    for entry in sys.path:
        path = entry or os.getcwd()
        try:
            info = os.stat(path)
        except OSError:
            parts.append((path, None))
            continue
        if not os.path.isdir(path):  # a zip file on the path
            parts.append((path, info.st_mtime_ns, info.st_size))
            continue
        try:
            with os.scandir(path) as listing:
                meta = sorted((e.name, e.stat().st_mtime_ns) for e in listing
                              if e.name.endswith((".dist-info", ".egg-info")))
        except OSError:
            meta = None
        parts.append((path, info.st_mtime_ns, meta))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


#: How many keys (installed sets, or the same set seen from another working directory) the file keeps.
KEEP = 4


def _remembered() -> dict[str, list[str]]:
    """``packages_distributions()`` from the cache file where it holds the current key; else computed
    and added there (the oldest of :data:`KEEP` dropped). A fresh dictionary every call, as the
    standard library's is."""
    where = cache_file()
    key = distributions_key()
    entries: list = []
    if where is not None:
        try:
            entries = [e for e in json.loads(where.read_text())["entries"]
                       if isinstance(e["key"], str) and isinstance(e["distributions"], dict)]
        except (OSError, ValueError, KeyError, TypeError):
            entries = []  # missing, unreadable or not ours: computed again below
        for entry in entries:
            if entry["key"] == key:
                return {name: list(dists) for name, dists in entry["distributions"].items()}
    mapping = dict(_COMPUTE())
    if where is not None:
        try:
            from ._atomic import atomic_write_text

            where.parent.mkdir(parents=True, exist_ok=True)
            entries = [{"key": key, "distributions": mapping}] + entries[: KEEP - 1]
            atomic_write_text(where, json.dumps({"entries": entries}))
        except OSError:
            pass  # a read-only home: computed every time, as before
    return {name: list(dists) for name, dists in mapping.items()}


def remember_distributions() -> bool:
    """Answer ``importlib.metadata.packages_distributions()`` from the cache (the module docstring)
    until :func:`forget_distributions`; ``False`` (nothing changed) if ``OSDN_DIAG_DIST_CACHE`` is off."""
    if cache_file() is None:
        return False
    importlib.metadata.packages_distributions = _remembered
    return True


def forget_distributions() -> None:
    """Give ``importlib.metadata.packages_distributions`` back to the standard library."""
    if importlib.metadata.packages_distributions is _remembered:
        importlib.metadata.packages_distributions = _COMPUTE
