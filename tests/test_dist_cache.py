"""``importlib.metadata.packages_distributions()`` answered from the osdn-diag cache (``_dist_cache``).

The answer must be the standard library's, also after a package is installed (a new ``*.dist-info``
on ``sys.path``) or removed; a cache file that is damaged or cannot be written changes nothing but
the time; ``OSDN_DIAG_DIST_CACHE=off`` leaves the function alone; and a model command answers it from
the cache while it runs and gives the function back when it ends.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import stat
import sys

import pytest

from osdn_diag.runtime import dist_cache as dc

_STDLIB = importlib.metadata.packages_distributions  # the standard library's, before any test replaces it


def _stdlib():
    return _STDLIB()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "distributions.json"
    monkeypatch.setenv(dc.ENV, str(path))
    yield path
    dc.forget_distributions()


def _fake_distribution(folder, name: str, top: str) -> None:
    info = folder / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{top}\n")


def test_the_cached_answer_is_the_standard_librarys(cache, monkeypatch):
    expected = _stdlib()
    assert dc.remember_distributions()
    assert importlib.metadata.packages_distributions is not _STDLIB
    first = importlib.metadata.packages_distributions()  # computed, and written
    assert first == expected and cache.is_file()

    def not_asked():
        raise AssertionError("computed again, though the cache holds the answer")

    monkeypatch.setattr(dc, "_replaced", not_asked)
    second = importlib.metadata.packages_distributions()  # from the file
    assert second == expected
    second["torch"].append("changed by the caller")
    assert importlib.metadata.packages_distributions() == expected  # every answer a fresh copy
    monkeypatch.setattr(dc, "_replaced", _STDLIB)
    dc.forget_distributions()
    assert importlib.metadata.packages_distributions is _STDLIB


def test_installing_or_removing_a_package_is_seen(cache, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    dc.remember_distributions()
    assert "osdn_fake_pkg" not in importlib.metadata.packages_distributions()
    _fake_distribution(site, "osdn-fake-dist", "osdn_fake_pkg")  # installed
    assert importlib.metadata.packages_distributions()["osdn_fake_pkg"] == ["osdn-fake-dist"]
    assert importlib.metadata.packages_distributions() == _stdlib()
    shutil.rmtree(site / "osdn-fake-dist-1.0.dist-info")  # removed
    assert "osdn_fake_pkg" not in importlib.metadata.packages_distributions()
    # Installed again (new times, so a new key): the file keeps at most KEEP keys, none twice.
    _fake_distribution(site, "osdn-fake-dist", "osdn_fake_pkg")
    keys = [e["key"] for e in json.loads(cache.read_text())["entries"]]
    assert len(keys) == len(set(keys)) <= dc.KEEP


@pytest.fixture
def default_cache(tmp_path, monkeypatch):
    """The cache at its default place (the package's own folder), in a temporary XDG_CACHE_HOME."""
    monkeypatch.delenv(dc.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    yield dc.cache_file()
    dc.forget_distributions()


def test_a_damaged_or_unwritable_cache_changes_nothing(default_cache, tmp_path, monkeypatch):
    """At the default place, the package's own folder, a damaged cache is rewritten (a file that
    OSDN_DIAG_DIST_CACHE names is the user's: see the next test)."""
    cache = default_cache
    expected = _stdlib()
    dc.remember_distributions()
    cache.parent.mkdir(parents=True)
    for damaged in ("{not json", json.dumps({"entries": [{"key": dc.distributions_key()}]}),
                    json.dumps({"entries": [{"key": dc.distributions_key(), "distributions": [1]}]}), "[]"):
        cache.write_text(damaged)
        assert importlib.metadata.packages_distributions() == expected
        assert json.loads(cache.read_text())["entries"][0]["key"] == dc.distributions_key()  # rewritten
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(dc.ENV, str(blocked / "distributions.json"))  # its folder cannot be made
    assert importlib.metadata.packages_distributions() == expected


def test_a_file_named_that_is_not_a_cache_of_ours_is_refused_never_replaced(tmp_path, monkeypatch, capsys):
    """OSDN_DIAG_DIST_CACHE=FILE replaced FILE whatever it held: a file of notes became the cache, and a
    symbolic link there was replaced by it; a folder was taken without a word (the cache then never
    kept). Now a model command refuses, as it starts, a FILE that is a link, a folder or a file that is
    not a cache osdn-diag wrote (one line naming the variable and the file, exit status 2, nothing
    written), and a file put there while it runs is not replaced; a new file, an
    empty one and a cache of ours (also one an earlier version wrote, without its "format") are used."""
    from osdn_diag.cli import entry

    notes, target, link = tmp_path / "notes.txt", tmp_path / "target.json", tmp_path / "link.json"
    notes.write_text("my notes, not a cache\n")
    target.write_text("{}")
    link.symlink_to(target)
    folder = tmp_path / "folder"
    folder.mkdir()
    out = tmp_path / "run"
    for named, what in ((notes, "exists and is not a cache osdn-diag wrote"), (link, "is a symbolic link"),
                        (folder, "is a folder, not a file")):
        monkeypatch.setenv(dc.ENV, str(named))
        capsys.readouterr()
        assert entry(["capture", "random:deltanet-tiny", "--prompts", "random", "--out", str(out), "-q"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"osdn-diag: error: {dc.ENV}={str(named)!r}: {named} {what}") and err.count("\n") == 1
        assert importlib.metadata.packages_distributions is _STDLIB and not out.exists()
    assert notes.read_text() == "my notes, not a cache\n" and link.is_symlink() and target.read_text() == "{}"
    assert folder.is_dir() and not any(folder.iterdir())
    # Put there after the command started: computed, not replaced.
    fresh = tmp_path / "fresh.json"
    monkeypatch.setenv(dc.ENV, str(fresh))
    try:
        assert dc.remember_distributions()
        fresh.write_text("[]")
        assert importlib.metadata.packages_distributions() == _stdlib() and fresh.read_text() == "[]"
        fresh.unlink()
        assert importlib.metadata.packages_distributions() == _stdlib()  # new: written
        assert json.loads(fresh.read_text())["format"] == dc.FORMAT
    finally:
        dc.forget_distributions()
    for text in ("", json.dumps({"entries": []}), fresh.read_text()):  # empty, an earlier version's, ours
        fresh.write_text(text)
        try:
            assert dc.remember_distributions()
            assert importlib.metadata.packages_distributions() == _stdlib()
        finally:
            dc.forget_distributions()
        assert json.loads(fresh.read_text())["format"] == dc.FORMAT
    # At the default place a link is not refused (nobody named it), but neither read nor replaced.
    monkeypatch.delenv(dc.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    dc.cache_file().parent.mkdir(parents=True)
    dc.cache_file().symlink_to(target)
    try:
        assert dc.remember_distributions()
        assert importlib.metadata.packages_distributions() == _stdlib()
    finally:
        dc.forget_distributions()
    assert dc.cache_file().is_symlink() and target.read_text() == "{}"


def test_off_leaves_the_function_alone(monkeypatch):
    monkeypatch.setenv(dc.ENV, "off")
    assert dc.cache_file() is None
    assert not dc.remember_distributions()
    assert importlib.metadata.packages_distributions is _STDLIB


def test_the_default_file_is_in_the_osdn_diag_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(dc.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert dc.cache_file() == tmp_path / "osdn-diag" / "distributions.json"


def test_a_model_command_uses_the_cache_while_it_runs(cache, tmp_path, monkeypatch):
    from osdn_diag import cli
    from osdn_diag.cli import commands, dispatch

    seen = []

    def command(args):
        seen.append(importlib.metadata.packages_distributions is dc._remembered)
        raise ValueError("stopped here")

    monkeypatch.setattr(commands, "_cmd_capture", command)
    with pytest.raises(ValueError, match="stopped here"):
        cli.main(["capture", "random:deltanet-tiny", "--prompts", "random", "--out", str(tmp_path / "r")])
    assert seen == [True]
    assert importlib.metadata.packages_distributions is _STDLIB  # given back, also after an error


def test_metadata_the_key_must_see(cache, tmp_path, monkeypatch):
    """Metadata rewritten in place, folder names in capitals, an unpacked egg, and a dangling link
    beside a real package: the answer stays the standard library's."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    dc.remember_distributions()
    _fake_distribution(site, "osdn-fake-dist", "old_pkg")
    assert importlib.metadata.packages_distributions()["old_pkg"] == ["osdn-fake-dist"]
    (site / "osdn-fake-dist-1.0.dist-info" / "top_level.txt").write_text("new_pkg\n")  # in place
    answer = importlib.metadata.packages_distributions()
    assert answer == _stdlib() and "new_pkg" in answer and "old_pkg" not in answer
    upper = site / "Upper-1.0.DIST-INFO"
    upper.mkdir()
    (upper / "METADATA").write_text("Metadata-Version: 2.1\nName: upper\nVersion: 1.0\n")
    (upper / "top_level.txt").write_text("upper_pkg\n")
    egg = site / "eggy-1.0-py3.11.egg" / "EGG-INFO"
    egg.mkdir(parents=True)
    (egg / "PKG-INFO").write_text("Metadata-Version: 1.1\nName: eggy\nVersion: 1.0\n")
    (egg / "top_level.txt").write_text("eggy_pkg\n")
    monkeypatch.syspath_prepend(str(site / "eggy-1.0-py3.11.egg"))
    (site / "broken-1.0.dist-info").symlink_to(tmp_path / "nowhere")
    answer = importlib.metadata.packages_distributions()
    assert answer == _stdlib() and "upper_pkg" in answer and "eggy_pkg" in answer
    (upper / "top_level.txt").write_text("upper_pkg\nupper_two\n")
    (egg / "top_level.txt").write_text("eggy_pkg\neggy_two\n")
    answer = importlib.metadata.packages_distributions()
    assert answer == _stdlib() and "upper_two" in answer and "eggy_two" in answer


def test_outputs_beside_the_packages_keep_the_key(tmp_path, monkeypatch):
    """``python -m`` puts the working directory on sys.path, where commands write their outputs."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = dc.distributions_key()
    (tmp_path / "runs" / "paper").mkdir(parents=True)
    (tmp_path / "notes.txt").write_text("a run")
    assert dc.distributions_key() == before


def test_another_finder_of_distributions_is_asked_as_usual(cache, monkeypatch):
    class Bundled(importlib.metadata.DistributionFinder):
        def find_spec(self, *args, **kwargs):
            return None

        def find_distributions(self, context=None):
            return iter(())

    dc.remember_distributions()
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, Bundled()])
    assert importlib.metadata.packages_distributions() == _stdlib()
    assert not cache.exists()  # not cached: what that finder lists is not in the key


def test_damaged_entries_of_the_current_key_are_not_trusted(cache):
    expected = _stdlib()
    dc.remember_distributions()
    cache.parent.mkdir(parents=True)
    key = dc.distributions_key()
    for bad in ("[" * 100_000, {"torch": 1}, {"torch": "torch"}, {"torch": None}, {"torch": [1]}, [1]):
        text = bad if isinstance(bad, str) else json.dumps({"entries": [{"key": key, "distributions": bad}]})
        cache.write_text(text)
        assert importlib.metadata.packages_distributions() == expected, bad


def test_a_removed_working_directory(cache, tmp_path, monkeypatch):
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    monkeypatch.syspath_prepend("")
    dc.remember_distributions()
    gone.rmdir()
    assert importlib.metadata.packages_distributions() == _stdlib()


def test_a_cache_path_that_is_no_regular_file(tmp_path, monkeypatch):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    monkeypatch.setenv(dc.ENV, str(fifo))
    dc.remember_distributions()
    try:
        assert importlib.metadata.packages_distributions() == _stdlib()
    finally:
        dc.forget_distributions()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    for value in ("on", "1", "yes", "TRUE"):  # the default place, not a file named so
        monkeypatch.setenv(dc.ENV, value)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert dc.cache_file() == tmp_path / "xdg" / "osdn-diag" / "distributions.json"


def test_the_function_before_is_the_function_after(cache, tmp_path, monkeypatch):
    from osdn_diag import cli
    from osdn_diag.cli import commands, dispatch

    def theirs():
        return _stdlib()

    monkeypatch.setattr(importlib.metadata, "packages_distributions", theirs)
    dc.remember_distributions()
    assert importlib.metadata.packages_distributions is not theirs
    dc.forget_distributions()
    assert importlib.metadata.packages_distributions is theirs
    monkeypatch.setattr(importlib.metadata, "packages_distributions", _STDLIB)

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(dispatch, "_quiet_libraries", interrupted)  # Ctrl-C while the libraries load
    with pytest.raises(KeyboardInterrupt):
        cli.main(["capture", "random:deltanet-tiny", "--prompts", "random", "--out", str(tmp_path / "r")])
    assert importlib.metadata.packages_distributions is _STDLIB
