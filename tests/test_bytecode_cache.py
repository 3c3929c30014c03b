"""Bytecode kept in a cache of the package's own under ``PYTHONDONTWRITEBYTECODE`` (:mod:`osdn_diag.runtime.bytecode`):
where the cache is, when torch counts as shipping its bytecode, and what ``keep_bytecode()`` and the console
script do to a fresh interpreter (they change ``sys.pycache_prefix``, so those checks run in subprocesses)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from osdn_diag.runtime import bytecode as _bytecode
from osdn_diag.runtime.bytecode import cache_dir

ROOT = Path(__file__).resolve().parents[1]
PATCH = 'import osdn_diag.runtime.bytecode as bc\nbc._ships_bytecode = lambda package="torch": False\n'


def test_cache_dir_default_explicit_and_off(monkeypatch, tmp_path):
    """Default under ``$XDG_CACHE_HOME``, else ``~/.cache``; ``OSDN_DIAG_PYCACHE=DIR`` is DIR; ``off`` is None."""
    monkeypatch.delenv("OSDN_DIAG_PYCACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "osdn-diag" / "pycache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "osdn-diag" / "pycache"
    monkeypatch.setenv("OSDN_DIAG_PYCACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.setenv("OSDN_DIAG_PYCACHE", "off")
    assert cache_dir() is None


def test_ships_bytecode_reads_the_installed_pycache(monkeypatch, tmp_path):
    """A package with ``__pycache__/__init__.<tag>.pyc`` ships bytecode, one without does not, a
    missing package counts as shipping it (nothing to gain)."""
    name = f"shipspkg_{uuid.uuid4().hex[:8]}"
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert _bytecode._ships_bytecode(name) is False
    (package / "__pycache__").mkdir()
    (package / "__pycache__" / "__init__.other-99.pyc").write_bytes(b"")  # another interpreter's
    assert _bytecode._ships_bytecode(name) is False
    (package / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc").write_bytes(b"")
    assert _bytecode._ships_bytecode(name) is True
    assert _bytecode._ships_bytecode(f"nosuchpkg_{uuid.uuid4().hex[:8]}") is True


def _fake_package(tmp_path):
    """A package ``fakepkg_<hex>`` under ``tmp_path/src``: (its name, its folder)."""
    name = f"fakepkg_{uuid.uuid4().hex[:8]}"
    folder = tmp_path / "src" / name
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("VALUE = 1\n")
    return name, folder


def _env(tmp_path, pycache, dont_write=True):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPYCACHEPREFIX", "OSDN_DIAG_PYCACHE", "PYTHONDONTWRITEBYTECODE")}
    env.update(OSDN_DIAG_PYCACHE=pycache, PYTHONPATH=os.pathsep.join([str(tmp_path / "src"), str(ROOT)]))
    if dont_write:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _run(code, env):
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


def _keep(tmp_path, pycache, patch=True, dont_write=True):
    """Call ``keep_bytecode()`` in a fresh interpreter, then import a fake package: (the package's
    folder, what keep_bytecode returned, sys.pycache_prefix after)."""
    name, folder = _fake_package(tmp_path)
    code = (PATCH if patch else "") + (
        "import json, sys\nfrom osdn_diag.runtime.bytecode import keep_bytecode\nroot = keep_bytecode()\n"
        f"import {name}\nprint(json.dumps([None if root is None else str(root), sys.pycache_prefix]))\n")
    root, prefix = json.loads(_run(code, _env(tmp_path, pycache, dont_write)))
    return folder, root, prefix


def _pycs(folder, name):
    return sorted(p for p in Path(folder).rglob("*.pyc") if name in str(p))


def test_keep_bytecode_writes_into_the_cache_folder_only(tmp_path):
    """``PYTHONDONTWRITEBYTECODE`` and a torch without bytecode: the cache folder becomes
    ``sys.pycache_prefix`` and the fake package's .pyc lands there, none beside its source."""
    pyc = tmp_path / "pyc"
    folder, root, prefix = _keep(tmp_path, str(pyc))
    assert root == str(pyc) and prefix == str(pyc)
    assert _pycs(pyc, folder.name), list(pyc.rglob("*"))
    assert not (folder / "__pycache__").exists()


def test_keep_bytecode_off_writes_nothing(tmp_path):
    """``OSDN_DIAG_PYCACHE=off``: returns None, no prefix, no .pyc anywhere."""
    folder, root, prefix = _keep(tmp_path, "off")
    assert root is None and prefix is None
    assert _pycs(tmp_path, folder.name) == []


def test_keep_bytecode_changes_nothing_when_bytecode_is_written_anyway(tmp_path):
    """Without ``PYTHONDONTWRITEBYTECODE``: returns None, no prefix (Python writes beside the source as usual)."""
    pyc = tmp_path / "pyc"
    folder, root, prefix = _keep(tmp_path, str(pyc), dont_write=False)
    assert root is None and prefix is None
    assert not pyc.exists()


def test_keep_bytecode_changes_nothing_when_torch_ships_bytecode(tmp_path):
    """torch installed with its bytecode (as here): returns None, no prefix, no .pyc written."""
    assert _bytecode._ships_bytecode() is True
    pyc = tmp_path / "pyc"
    folder, root, prefix = _keep(tmp_path, str(pyc), patch=False)
    assert root is None and prefix is None
    assert _pycs(tmp_path, folder.name) == []


def test_console_script_keeps_bytecode(tmp_path):
    """``osdn_diag.cli.entry`` calls ``keep_bytecode()`` first: after ``prove --help`` the prefix is the folder."""
    pyc = tmp_path / "pyc"
    code = PATCH + (
        "import sys\nfrom osdn_diag.cli import entry\n"
        "try:\n    entry(['prove', '--help'])\nexcept SystemExit:\n    pass\nprint(sys.pycache_prefix)\n")
    assert _run(code, _env(tmp_path, str(pyc))) == str(pyc)
