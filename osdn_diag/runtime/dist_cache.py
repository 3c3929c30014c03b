"""``importlib.metadata.packages_distributions()``, remembered between processes.

transformers before 5.24 calls it while it is being imported (``transformers.utils.import_utils`` builds a
module-level mapping from it). It reads the metadata of every installed distribution, and the whole
file list (``RECORD``) of each one without a ``top_level.txt``: on one H200 host, with transformers
5.17 and 223 names, that was 1.0 s of every command (``benchmarks/results/dist_cache_h200_2026-12-03_s17.txt``).

:func:`remember_distributions` answers it from a file in the osdn-diag cache instead
(``$XDG_CACHE_HOME/osdn-diag/distributions.json``, else ``~/.cache/osdn-diag/distributions.json``),
kept under a key of what is installed: for every ``sys.path`` folder, its metadata folders
(``*.dist-info``, ``*.egg-info``, an unpacked egg's ``EGG-INFO``) with the modification time and size
of each file of theirs that is read. Installing, removing, upgrading or editing a package's metadata
changes the key, and the mapping is computed again (and the file rewritten atomically; it keeps the
:data:`KEEP` latest keys). What the key cannot see is not cached: where a finder other than the
standard one on ``sys.meta_path`` lists distributions, the function is asked as usual; so it is
where the key cannot be read or the cache is not a regular file. A metadata file rewritten with the
same time and size is not seen. Reading the key costs one listing per ``sys.path`` folder and a few
``stat`` calls per package. Only ``packages_distributions`` is replaced, and only until
:func:`forget_distributions`; a cache that cannot be read or written is ignored.
``OSDN_DIAG_DIST_CACHE=off`` leaves the function alone; ``OSDN_DIAG_DIST_CACHE=FILE`` keeps the mapping
in ``FILE``, which must be new, empty or a cache osdn-diag wrote (:func:`check_cache_file`): any other
file there is the user's, and is refused rather than replaced. A symbolic link is never read, written
through nor replaced, at ``FILE`` or at the default place.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.metadata
import json
import os
import stat
import sys
from pathlib import Path

from .cache_paths import OFF, ON, cache_path

__all__ = ["ENV", "KEEP", "cache_file", "check_cache_file", "distributions_key", "forget_distributions",
           "remember_distributions"]

ENV = "OSDN_DIAG_DIST_CACHE"
#: What the cache file says it is (its ``"format"``): files without it are not the package's to replace.
FORMAT = "osdn-diag packages_distributions cache"


def cache_file() -> Path | None:
    """Where the mapping is kept, or ``None`` if ``OSDN_DIAG_DIST_CACHE`` is off."""
    return cache_path(ENV, "distributions.json")


#: The files of a metadata folder that ``packages_distributions`` reads (the names it reports, the
#: top-level names a distribution declares, or the file list they are inferred from).
_METADATA_FILES = ("METADATA", "PKG-INFO", "top_level.txt", "RECORD", "SOURCES.txt", "installed-files.txt")


def _metadata_folders(folder: str) -> list[tuple[str, str]]:
    """``(name, path)`` of the metadata folders directly in ``folder``, as the standard library finds
    them: ``*.dist-info`` and ``*.egg-info`` in any case, and the ``EGG-INFO`` of an unpacked ``*.egg``."""
    out = []
    with os.scandir(folder) as listing:
        for entry in listing:
            low = entry.name.lower()
            if low.endswith((".dist-info", ".egg-info")):
                out.append((entry.name, entry.path))
            elif low.endswith(".egg"):
                out.append((entry.name, os.path.join(entry.path, "EGG-INFO")))
    return sorted(out)


def _stat(path: str) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


def distributions_key() -> str:
    """A digest of what ``packages_distributions`` reads: each ``sys.path`` entry (a folder with its
    metadata folders and the time and size of the files of theirs it reads, or a file with its time
    and size). A folder's own modification time is left out: outputs written into the working
    directory, which ``python -m`` puts on ``sys.path``, would change it at every command."""
    parts: list = [sys.version, sys.path]
    for entry in sys.path:
        path = os.path.abspath(entry or os.curdir)
        if not os.path.isdir(path):  # a zip file on the path, or nothing
            parts.append((path, _stat(path)))
            continue
        try:
            folders = _metadata_folders(path)
        except OSError:
            parts.append((path, None))
            continue
        parts.append((path, [(name, _stat(meta), [_stat(os.path.join(meta, f)) for f in _METADATA_FILES])
                             for name, meta in folders]))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


#: How many keys (installed sets, or the same set seen from another working directory) the file keeps.
KEEP = 4


def _usable(where: Path) -> bool:
    """Whether ``where`` may be read and replaced: a regular file, or nothing yet (never a device such
    as ``/dev/null``, a pipe, a folder, nor a symbolic link, whatever it points to)."""
    try:
        return stat.S_ISREG(os.lstat(where).st_mode)
    except FileNotFoundError:
        return True
    except OSError:
        return False


def _named() -> str | None:
    """``OSDN_DIAG_DIST_CACHE`` where it names a file of the user's choosing (not off, not on)."""
    setting = os.environ.get(ENV, "").strip()
    return setting if setting and setting.lower() not in OFF + ON else None


def _is_ours(text: str) -> bool:
    """Whether ``text`` is a cache osdn-diag wrote, or nothing: ``{"format": FORMAT, "entries": [...]}``,
    or the ``{"entries": [...]}`` alone of earlier versions; an empty file holds nothing to lose."""
    if not text.strip():
        return True
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return False
    if not isinstance(value, dict) or not isinstance(value.get("entries"), list):
        return False
    return value.get("format") == FORMAT or set(value) == {"entries"}


#: The largest cache file :func:`check_cache_file` reads (bytes): a few hundred installed names take
#: tens of kilobytes.
_LIMIT = 64 << 20


def check_cache_file() -> None:
    """Refuse (:class:`ValueError`, one line naming ``OSDN_DIAG_DIST_CACHE`` and the file) a ``FILE`` that
    the variable names where it is a symbolic link, or a regular file that is not one of this cache's
    (:func:`_is_ours`): the cache is written by a rename over its name, which would replace the user's
    file or link. A folder is refused too: no cache could be kept there, and a file was meant. Nothing
    there, a file of this cache, or no file named (off, the default place): fine."""
    setting = _named()
    where = cache_file()
    if setting is None or where is None:
        return
    if os.path.islink(where):
        raise ValueError(f"{ENV}={setting!r}: {where} is a symbolic link; osdn-diag never writes through a link "
                         f"nor replaces one: give the path of a file of its own, or {ENV}=off")
    if os.path.isdir(where):  # the cache would never be kept: a file was meant (the folder left as it is)
        raise ValueError(f"{ENV}={setting!r}: {where} is a folder, not a file; give the path of a file (e.g. "
                         f"{where / 'distributions.json'}), or {ENV}=off")
    if not _usable(where):  # a FIFO, a device: never read nor written (computed every time)
        return
    try:
        with open(where, "rb") as fh:
            data = fh.read(_LIMIT + 1)
    except FileNotFoundError:
        return
    except OSError as err:
        raise ValueError(f"{ENV}={setting!r}: {where} cannot be read ({err.strerror or err}), so osdn-diag cannot "
                         f"tell it is its cache before replacing it; give another file, or {ENV}=off") from None
    try:
        ours = len(data) <= _LIMIT and _is_ours(data.decode("utf-8"))
    except UnicodeDecodeError:
        ours = False
    if not ours:
        raise ValueError(f"{ENV}={setting!r}: {where} exists and is not a cache osdn-diag wrote, which it would "
                         f"replace; give a new file (or {ENV}=off), or remove that one if it is not needed")


def _valid(mapping) -> bool:
    return isinstance(mapping, dict) and all(
        isinstance(name, str) and isinstance(dists, list) and all(d is None or isinstance(d, str) for d in dists)
        for name, dists in mapping.items())


def _answer(compute) -> dict[str, list[str]]:
    """``packages_distributions()`` from the cache file where it holds the current key; else computed
    (by ``compute``) and added there, the oldest of :data:`KEEP` dropped. The standard library's own
    answer wherever the cache cannot be trusted: another finder of distributions on ``sys.meta_path``
    (its answers are not in the key), a key that cannot be read, a file that is not a regular file."""
    where = cache_file()
    if where is None or any(hasattr(f, "find_distributions") and f is not importlib.machinery.PathFinder
                            for f in sys.meta_path):
        return compute()
    try:
        key = distributions_key()
    except Exception:  # e.g. the working directory removed under a running process
        return compute()
    if not _usable(where):
        return compute()
    entries: list = []
    # The file the variable names is rewritten only where it is nothing yet or a cache of ours
    # (check_cache_file refused it otherwise as the command started); the default place is ours.
    writable = _named() is None
    try:
        text = where.read_text()
        writable = writable or _is_ours(text)
        entries = [e for e in json.loads(text)["entries"]
                   if isinstance(e["key"], str) and _valid(e["distributions"])]
    except FileNotFoundError:
        writable = True
    except Exception:  # unreadable, or not ours (any shape, however deep): computed again below
        entries = []
    for entry in entries:
        if entry["key"] == key:
            return {name: list(dists) for name, dists in entry["distributions"].items()}
    mapping = dict(compute())
    if not writable:
        return {name: list(dists) for name, dists in mapping.items()}
    try:
        from .atomic import atomic_write_text, refuse_link

        where.parent.mkdir(parents=True, exist_ok=True)
        entries = [{"key": key, "distributions": mapping}] + entries[: KEEP - 1]
        refuse_link(where)  # a link put there since: not replaced (LinkError is a ValueError)
        atomic_write_text(where, json.dumps({"format": FORMAT, "entries": entries}))
    except (OSError, TypeError, ValueError):
        pass  # a read-only home, or names JSON cannot hold: computed every time, as before
    return {name: list(dists) for name, dists in mapping.items()}


#: The function :func:`remember_distributions` replaced, called to compute, given back by
#: :func:`forget_distributions`.
_replaced = None


def _remembered() -> dict[str, list[str]]:
    return _answer(_replaced or importlib.metadata.packages_distributions)


def remember_distributions() -> bool:
    """Answer ``importlib.metadata.packages_distributions()`` from the cache (the module docstring)
    until :func:`forget_distributions`; ``False`` (nothing changed) if ``OSDN_DIAG_DIST_CACHE`` is off.
    A ``FILE`` it names that is a link or not a cache of ours is refused first (:func:`check_cache_file`)."""
    global _replaced
    if cache_file() is None:
        return False
    check_cache_file()
    if importlib.metadata.packages_distributions is not _remembered:
        _replaced = importlib.metadata.packages_distributions
        importlib.metadata.packages_distributions = _remembered
    return True


def forget_distributions() -> None:
    """Give ``importlib.metadata.packages_distributions`` back: the function that was there before
    :func:`remember_distributions` (unless something else has replaced the cache's since)."""
    global _replaced
    if importlib.metadata.packages_distributions is _remembered and _replaced is not None:
        importlib.metadata.packages_distributions = _replaced
        _replaced = None
