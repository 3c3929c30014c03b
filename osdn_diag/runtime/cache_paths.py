"""Where osdn-diag keeps what it caches between processes, and the environment variables that move it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["OFF", "ON", "cache_path"]

#: Values of a cache's environment variable that turn the cache off, and that keep it where it is by default.
OFF = ("off", "0", "no", "false")
ON = ("on", "1", "yes", "true")


def cache_path(env: str, name: str) -> Path | None:
    """The path of the cache ``name`` (a file or a folder): ``None`` if the variable ``env`` is off, the
    path it gives if it gives one (``on``, ``1``, ``yes``, ``true`` give none), else
    ``$XDG_CACHE_HOME/osdn-diag/NAME`` (``~/.cache/osdn-diag/NAME``)."""
    setting = os.environ.get(env, "").strip()
    if setting.lower() in OFF:
        return None
    if setting and setting.lower() not in ON:
        return Path(setting).expanduser()
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home, "osdn-diag", name)
