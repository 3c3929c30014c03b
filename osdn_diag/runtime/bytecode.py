"""Compiled bytecode for a process started with ``PYTHONDONTWRITEBYTECODE`` set.

Container images often set ``PYTHONDONTWRITEBYTECODE=1`` and ship torch without its ``__pycache__``:
every start then compiles torch, transformers and fla from source again. On one
H200 that was 11 s of a 27 s command (``docs/performance.md``). The console script therefore keeps
the bytecode of what it imports in a cache of its own (``sys.pycache_prefix``): the installed
packages stay untouched, which is what that setting usually protects.

``OSDN_DIAG_PYCACHE=off`` honours ``PYTHONDONTWRITEBYTECODE`` fully; ``OSDN_DIAG_PYCACHE=DIR`` puts the
cache in ``DIR`` (default: ``$XDG_CACHE_HOME/osdn-diag/pycache``, else ``~/.cache/osdn-diag/pycache``).
Nothing changes when bytecode is written anyway, or when ``PYTHONPYCACHEPREFIX`` chose a place.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .cache_paths import cache_path

__all__ = ["ENV", "cache_dir", "keep_bytecode"]

ENV = "OSDN_DIAG_PYCACHE"


def cache_dir() -> Path | None:
    """Where :func:`keep_bytecode` keeps bytecode, or ``None`` if ``OSDN_DIAG_PYCACHE`` is off."""
    return cache_path(ENV, "pycache")


def _ships_bytecode(package: str = "torch") -> bool:
    """Whether ``package`` (found, not imported) has the compiled bytecode of its ``__init__`` beside
    it, as pip writes it at install time; ``True`` if the package is not found (nothing to gain)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return True
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return True
    folder, name = os.path.split(spec.origin)
    tag = sys.implementation.cache_tag
    return os.path.exists(os.path.join(folder, "__pycache__", f"{name[:-3]}.{tag}.pyc"))


def keep_bytecode() -> Path | None:
    """Cache bytecode under :func:`cache_dir` for the rest of this process if Python was told not to
    write any (``sys.dont_write_bytecode``), no ``sys.pycache_prefix`` is set, and torch was installed
    without its bytecode (where it has it, the installed bytecode is read as usual and a second copy
    would only cost a first compilation); returns the folder, or ``None`` when nothing changed
    (including a folder that cannot be created or written)."""
    if not sys.dont_write_bytecode or sys.pycache_prefix is not None or _ships_bytecode():
        return None
    root = cache_dir()
    if root is None:
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(root, os.W_OK | os.X_OK):
        return None
    # Both are read at each import (importlib.util.cache_from_source, SourceLoader.get_code).
    sys.pycache_prefix = str(root)
    sys.dont_write_bytecode = False
    return root
