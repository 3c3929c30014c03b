"""``importlib.metadata.packages_distributions()`` answered from the osdn-diag cache (``_dist_cache``).

The answer must be the standard library's, also after a package is installed (a new ``*.dist-info``
on ``sys.path``) or removed; a cache file that is damaged or cannot be written changes nothing but
the time; ``OSDN_DIAG_DIST_CACHE=off`` leaves the function alone; and a model command answers it from
the cache while it runs and gives the function back when it ends.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import sys

import pytest

from osdn_diag import _dist_cache as dc


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
    expected = dc._COMPUTE()
    assert dc.remember_distributions()
    assert importlib.metadata.packages_distributions is not dc._COMPUTE
    first = importlib.metadata.packages_distributions()  # computed, and written
    assert first == expected and cache.is_file()
    calls = []
    monkeypatch.setattr(dc, "_COMPUTE", lambda: calls.append(1) or {})
    second = importlib.metadata.packages_distributions()  # from the file: the stdlib is not asked
    assert second == expected and calls == []
    second["torch"].append("changed by the caller")
    assert importlib.metadata.packages_distributions() == expected  # every answer a fresh copy
    dc.forget_distributions()
    assert importlib.metadata.packages_distributions is dc._COMPUTE


def test_installing_or_removing_a_package_is_seen(cache, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    dc.remember_distributions()
    assert "osdn_fake_pkg" not in importlib.metadata.packages_distributions()
    _fake_distribution(site, "osdn-fake-dist", "osdn_fake_pkg")  # installed
    assert importlib.metadata.packages_distributions()["osdn_fake_pkg"] == ["osdn-fake-dist"]
    assert importlib.metadata.packages_distributions() == dc._COMPUTE()
    shutil.rmtree(site / "osdn-fake-dist-1.0.dist-info")  # removed
    assert "osdn_fake_pkg" not in importlib.metadata.packages_distributions()
    # The file keeps the latest keys: the set seen before is answered again without computing.
    _fake_distribution(site, "osdn-fake-dist", "osdn_fake_pkg")
    keys = [e["key"] for e in json.loads(cache.read_text())["entries"]]
    assert len(keys) == len(set(keys)) <= dc.KEEP


def test_a_damaged_or_unwritable_cache_changes_nothing(cache, tmp_path, monkeypatch):
    expected = dc._COMPUTE()
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


def test_off_leaves_the_function_alone(monkeypatch):
    monkeypatch.setenv(dc.ENV, "off")
    assert dc.cache_file() is None
    assert not dc.remember_distributions()
    assert importlib.metadata.packages_distributions is dc._COMPUTE


def test_the_default_file_is_in_the_osdn_diag_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(dc.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert dc.cache_file() == tmp_path / "osdn-diag" / "distributions.json"


def test_a_model_command_uses_the_cache_while_it_runs(cache, tmp_path, monkeypatch):
    from osdn_diag import cli

    seen = []

    def command(args):
        seen.append(importlib.metadata.packages_distributions is dc._remembered)
        raise ValueError("stopped here")

    monkeypatch.setattr(cli, "_cmd_capture", command)
    with pytest.raises(ValueError, match="stopped here"):
        cli.main(["capture", "random:deltanet-tiny", "--prompts", "random", "--out", str(tmp_path / "r")])
    assert seen == [True]
    assert importlib.metadata.packages_distributions is dc._COMPUTE  # given back, also after an error
