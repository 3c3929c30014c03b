"""Files written all at once (:mod:`osdn_diag.runtime.atomic`): readable by whoever the umask lets read them,
on disk before they get their name, and no temporaries left behind by a killed writer once the run
directory is opened again."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from osdn_diag.runtime.atomic import atomic_path, atomic_write_text, remove_stale_temporaries


@pytest.fixture
def umask():
    """``umask(value)`` sets the process umask for the test; the old one is restored afterwards."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda value: os.umask(value)
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600), (0o002, 0o664)])
def test_the_file_gets_the_mode_open_would_give_it(tmp_path, umask, mask, mode):
    umask(mask)
    atomic_write_text(tmp_path / "a.json", "{}")
    with open(tmp_path / "plain.json", "w") as fh:  # what a plain open() gives, for comparison
        fh.write("{}")
    assert _mode(tmp_path / "a.json") == mode == _mode(tmp_path / "plain.json")
    with atomic_path(tmp_path / "b.bin") as tmp:
        Path(tmp).write_bytes(b"x")  # writers that open the temporary by name keep its mode
    assert _mode(tmp_path / "b.bin") == mode


def test_the_file_is_synced_before_its_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd):
        events.append(("fsync", "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"))
        fsync(fd)

    def spy_replace(src, dst):
        events.append(("replace", Path(dst).name))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    atomic_write_text(tmp_path / "a.json", "{}")
    assert events == [("fsync", "file"), ("replace", "a.json"), ("fsync", "dir")]
    assert (tmp_path / "a.json").read_text() == "{}"


def test_a_directory_that_cannot_be_synced_is_no_error(tmp_path, monkeypatch):
    """Some file systems refuse fsync on a directory: the file is in place all the same."""
    fsync = os.fsync

    def refuse_dirs(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(22, "Invalid argument")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", refuse_dirs)
    atomic_write_text(tmp_path / "a.json", "{}")
    assert (tmp_path / "a.json").read_text() == "{}"


def test_a_failed_write_leaves_neither_file_nor_temporary(tmp_path):
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "a.json") as tmp:
        Path(tmp).write_text("half")
        raise RuntimeError("writer failed")
    assert list(tmp_path.iterdir()) == []


def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    with atomic_path(tmp_path / "kept.json") as tmp:
        Path(tmp).write_text("{}")
        stale = Path(tmp)
    stale.write_text("half")  # what a writer killed before the rename leaves: its temporary
    old_style = tmp_path / ".summary.json.k3_x9a2q.tmp"  # tempfile.mkstemp's names, earlier versions
    old_style.write_text("half")
    keep = [tmp_path / n for n in (".hidden", ".x.tmp", "notes.tmp", "a.b.12345678.tmp", ".cfg.json.tmp")]
    for path in keep:
        path.write_text("mine")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".a.json.abcdefgh.tmp").write_text("half")  # other directories: not touched

    removed = remove_stale_temporaries(tmp_path)
    assert sorted(removed) == sorted([stale, old_style])
    assert not stale.exists() and not old_style.exists()
    assert all(p.exists() for p in keep) and (tmp_path / "kept.json").exists()
    assert (tmp_path / "sub" / ".a.json.abcdefgh.tmp").exists()
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_opening_a_run_directory_for_writing_removes_its_stale_temporaries(tmp_path):
    """A capture killed mid-write left temporaries beside the manifest and among the shards; writing
    into the directory again removes them (the reader never lists them, but they are dead weight and
    look like data to a colleague)."""
    from osdn_diag.capture.store import CaptureWriter

    shards = tmp_path / "capture" / "batch_00000"
    shards.mkdir(parents=True)
    stale = [tmp_path / ".manifest.json.abcd1234.tmp", shards / ".layer_000.safetensors.abcd1234.tmp"]
    for path in stale:
        path.write_text("half")
    CaptureWriter(tmp_path).begin({"versions": {}})
    assert not any(p.exists() for p in stale)
    assert (tmp_path / "manifest.json").is_file()


def test_replaying_into_a_directory_removes_its_stale_temporaries(tmp_path, monkeypatch):
    from osdn_diag import pipeline

    stale = tmp_path / "out" / ".summary.json.abcd1234.tmp"
    stale.parent.mkdir()
    stale.write_text("half")

    class Stop(Exception):
        pass

    class Reader:  # a complete run whose shards are never reached: only the preparation matters
        manifest: dict = {}

        def __init__(self, run_dir):
            pass

        def shards(self):
            raise Stop

    monkeypatch.setattr(pipeline.replaying, "CaptureReader", Reader)  # where the replay stage looks them up
    monkeypatch.setattr(pipeline.replaying, "Replayer", lambda *a, **k: None)
    with pytest.raises(Stop):
        pipeline.replay_run(tmp_path / "run", out_dir=tmp_path / "out", progress=False, device="cpu")
    assert not stale.exists()


def test_a_writer_that_replaces_the_temporary_still_gives_the_umask_mode(tmp_path, umask):
    """safetensors' save_file writes a 0600 file of its own and renames it over the temporary: the
    shard must still get the mode a plain open() would give."""
    import torch
    from safetensors.torch import save_file

    umask(0o022)
    with atomic_path(tmp_path / "layer_000.safetensors") as tmp:
        save_file({"x": torch.zeros(2)}, tmp, metadata={"run_id": "r"})
    assert _mode(tmp_path / "layer_000.safetensors") == 0o644


def test_the_proof_ledger_json_gets_the_umask_mode(tmp_path, umask):
    from osdn_diag.proofs import ledger

    umask(0o022)
    ledger.write_json([], tmp_path / "ledger.json")
    assert _mode(tmp_path / "ledger.json") == 0o644
    assert list(tmp_path.iterdir()) == [tmp_path / "ledger.json"]  # no temporary left


def test_a_killed_figure_writers_temporary_is_removed_too(tmp_path):
    """A report killed while drawing left ``.q_geo.png.XXXXXXXX.png``, which no cleanup matched: every
    temporary now ends ``.tmp`` or ``.tmp.EXT``, one pattern, and the old figure names go too (issue 44)."""
    with atomic_path(tmp_path / "q_geo.png", suffix=".png") as tmp:
        Path(tmp).write_bytes(b"png")
        name = Path(tmp).name
    (tmp_path / name).write_bytes(b"half")  # what a writer killed before its rename leaves
    assert name.startswith(".q_geo.png.") and name.endswith(".tmp.png")
    old = tmp_path / ".contraction.pdf.1a2b3c4d.pdf"  # what earlier versions named it
    old.write_bytes(b"half")
    mine = tmp_path / "figure.1a2b3c4d.png"
    mine.write_bytes(b"mine")
    assert sorted(remove_stale_temporaries(tmp_path)) == sorted([tmp_path / name, old])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figure.1a2b3c4d.png", "q_geo.png"]


def test_with_a_root_no_link_on_the_way_is_followed(tmp_path):
    from osdn_diag.runtime.atomic import LinkError

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "plots").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(LinkError, match="plots: a symbolic link"):
        atomic_write_text(run / "plots" / "a.txt", "x", root=run)
    (run / "b.txt").symlink_to(elsewhere / "b.txt")
    with pytest.raises(LinkError, match="b.txt: a symbolic link"):
        atomic_write_text(run / "b.txt", "x", root=run)
    assert list(elsewhere.iterdir()) == [] and (run / "b.txt").is_symlink()
    atomic_write_text(run / "ranks" / "r.json", "{}", root=run)  # real directories are made as needed
    assert (run / "ranks" / "r.json").read_text() == "{}"
    link_out = tmp_path / "out-link"  # the directory given may itself be a link: the user's choice
    link_out.symlink_to(run, target_is_directory=True)
    atomic_write_text(link_out / "c.txt", "x", root=link_out)
    assert (run / "c.txt").read_text() == "x"


def test_a_directory_where_a_file_goes_is_named_before_anything_is_written(tmp_path):
    """``plots/q_geo.png`` a directory: refused up front in one line naming it, not a raw
    ``[Errno 21] ... .tmp.png -> ...`` from the rename after the figure was drawn."""
    (tmp_path / "q_geo.png").mkdir()
    with pytest.raises(IsADirectoryError, match=r"q_geo.png: a directory, where osdn-diag writes a file"):
        with atomic_path(tmp_path / "q_geo.png", root=tmp_path, suffix=".png"):
            pytest.fail("the writer ran")
    assert [p.name for p in tmp_path.iterdir()] == ["q_geo.png"]


@pytest.mark.parametrize("via_link", [False, True])
@pytest.mark.parametrize("root", [False, True])
def test_a_fifo_or_device_where_a_file_goes_is_left_alone(tmp_path, via_link, root):
    """``prove --json /dev/null`` (or ``view --out``, ``OSDN_DIAG_TUNING``'s table, a monitor's file):
    the rename put a regular file in the place of the device — as root, of ``/dev/null`` itself, which
    every other process then wrote into. A FIFO stands in for the device here (creating one needs no
    privilege); ``/dev/stdout`` is a link to one, hence ``via_link``. Refused before the writer runs,
    naming the path, and the FIFO left as it was (issue 44)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = fifo
    if via_link:
        target = tmp_path / "out" / "link.json"
        target.parent.mkdir()
        target.symlink_to(fifo)
    with pytest.raises(ValueError, match=r"not a regular file \(a FIFO, a device"):
        with atomic_path(target, root=tmp_path if root and not via_link else None):
            pytest.fail("the writer ran")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name])
