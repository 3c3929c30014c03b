"""What a command may do to a directory (:mod:`osdn_diag.rundir`), on directories built here: the lock
never follows a link, a link where a run writes is refused (never followed nor replaced), names read
from a manifest or a rank record stay inside the run, and ``--overwrite`` removes the package's own
shards, including those an interrupted capture never listed, after refusing what it cannot remove
(issue 44)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from osdn_diag.rundir import LOCK_FILE, RunDirectoryError, output_lock, prepare_output, verify_files

SHARD = "capture/batch_00000/layer_000.safetensors"


def _run(root: Path, shards: dict | None = None) -> Path:
    """A directory holding a run (a manifest with a run id and stages) whose capture is one shard,
    listed unless ``shards`` says otherwise (a capture interrupted before it listed its shards)."""
    root.mkdir(parents=True, exist_ok=True)
    shard = root / SHARD
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"shard")
    entry = {"sha256": hashlib.sha256(b"shard").hexdigest(), "size": 5}
    listed = {SHARD: entry} if shards is None else shards
    (root / "manifest.json").write_text(json.dumps({"run_id": "a" * 32, "stages": {"capture": True},
                                                    "shards": listed}))
    return root


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "important.txt"
    secret.write_text("secret data")
    secret.chmod(0o600)
    return secret


# The lock file.

@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
def test_a_lock_path_that_is_a_link_is_refused_and_what_it_points_to_untouched(tmp_path, dangling):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "created.txt" if dangling else _secret(tmp_path)
    (run / LOCK_FILE).symlink_to(target)
    with pytest.raises(RunDirectoryError, match=f"{run / LOCK_FILE}: not a lock file osdn-diag made.*remove it"):
        with output_lock(run):
            pass
    if dangling:
        assert not target.exists()  # a dangling link does not create its target
    else:
        assert target.read_text() == "secret data" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert (run / LOCK_FILE).is_symlink()  # left as it was


def test_a_lock_file_its_holder_removes_between_open_and_fstat_is_made_anew(tmp_path, monkeypatch):
    """The holder unlinks the lock file as it leaves; a waiter that opened the old file just before
    sees it with no name (st_nlink 0): not a foreign file to refuse (two monitors sharing one
    monitor.parquet failed so now and then), but one to create again."""
    from osdn_diag import rundir

    lock = tmp_path / ".monitor.parquet.lock"
    lock.write_text("4242\n")
    real_fstat, calls = os.fstat, []

    def fstat(fd):
        if not calls:  # the holder leaves right after this process opened the file
            lock.unlink()
        calls.append(fd)
        return real_fstat(fd)

    monkeypatch.setattr(rundir.os, "fstat", fstat)
    fd, created = rundir._open_lock(lock)
    monkeypatch.setattr(rundir.os, "fstat", real_fstat)
    try:
        assert created and os.path.samestat(os.fstat(fd), os.lstat(lock))
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["hard link", "directory"])
def test_a_lock_path_that_is_not_a_file_of_its_own_is_refused(tmp_path, kind):
    run = tmp_path / "run"
    run.mkdir()
    if kind == "hard link":
        os.link(_secret(tmp_path), run / LOCK_FILE)
    else:
        (run / LOCK_FILE).mkdir()
    with pytest.raises(RunDirectoryError, match="not a lock file osdn-diag made"):
        with output_lock(run):
            pass
    if kind == "hard link":
        assert (tmp_path / "important.txt").read_text() == "secret data"


def test_a_lock_file_a_killed_command_left_is_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text("12345\n")
    with output_lock(run):
        assert (run / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    assert not (run / LOCK_FILE).exists()


@pytest.mark.parametrize("shared", [False, True], ids=["exclusive", "shared"])
def test_a_lock_file_its_holder_removed_before_the_lock_came_is_not_the_one_held(tmp_path, monkeypatch, shared):
    """Between opening the lock file and locking it, its holder may finish and remove it (a writer
    unlinks it while still holding it): the file then locked is no longer at the name, and a command
    that kept it would share no lock with the next one. Writers and readers both start again on the
    file at the name."""
    import fcntl

    from osdn_diag import rundir
    from osdn_diag.rundir import reading_lock

    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).write_text("")  # the holder's, about to be removed
    real, calls = fcntl.flock, []

    def flock(fd, op):
        if not calls:  # the holder leaves just before the first lock is taken
            (run / LOCK_FILE).unlink()
        calls.append(op)
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with (reading_lock(run) if shared else output_lock(run)):
        assert len(calls) >= 2  # the removed file's lock, then the new file's
        held = rundir._HELD[run.resolve()][1] if not shared else None
        if not shared:
            assert os.path.samestat(os.fstat(held), os.lstat(run / LOCK_FILE))
            assert (run / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        else:
            assert (run / LOCK_FILE).exists()
            with pytest.raises(RunDirectoryError):  # the file at the name is the one locked
                with output_lock(tmp_path / "run"):
                    pass
    assert not (run / LOCK_FILE).exists()


# Links where a run writes.

@pytest.mark.parametrize("name", ["capture", "capture/batch_00000", "plots", "ranks", "summary.json",
                                  "report.md", "plots/contraction.png"])
def test_overwrite_refuses_a_link_where_a_run_writes_and_removes_nothing(tmp_path, name):
    run = _run(tmp_path / "run")
    (run / "plots").mkdir()
    (run / "report.md").write_text("# old report")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "batch_00000").mkdir(parents=True)
    (elsewhere / "batch_00000" / "layer_000.safetensors").write_text("not the run's")  # a shard's name
    (elsewhere / "layer_000.safetensors").write_text("not the run's")
    link = run / name
    if link.is_dir():
        import shutil

        shutil.rmtree(link)
    elif link.exists():
        link.unlink()
    link.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match=f"{link}: a symbolic link, where osdn-diag writes.*remove the link"):
        prepare_output(run, overwrite=True)
    assert (run / "manifest.json").is_file() and link.is_symlink()  # nothing removed
    assert (elsewhere / "batch_00000" / "layer_000.safetensors").read_text() == "not the run's"
    assert (elsewhere / "layer_000.safetensors").read_text() == "not the run's"


def test_a_shard_is_never_written_below_a_link(tmp_path):
    import torch

    from osdn_diag.capture import CaptureWriter, KernelCall

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "capture").symlink_to(elsewhere, target_is_directory=True)
    writer = CaptureWriter(run)
    writer.begin({"versions": {}})
    x = torch.zeros(1, 2, 1, 4)
    call = KernelCall(layer=0, layer_name="l0", family="delta_rule", kernel="x", q=x, k=x, v=x,
                      beta=torch.zeros(1, 2, 1), o=x, scale=1.0)
    with pytest.raises(ValueError, match="capture: a symbolic link"):
        writer.write(0, [0], call)
    assert list(elsewhere.iterdir()) == []


# Names read from a manifest or a record.

@pytest.mark.parametrize("name", ["capture/../../outside/x", "/etc/passwd", "capture/batch_00000/../../../x",
                                  "capture/batch_0/layer_0.safetensors/..", "report.md", 3])
def test_a_name_not_of_the_runs_layout_is_refused(name):
    from osdn_diag.rundir import check_file_name

    with pytest.raises(RunDirectoryError, match="not the name of a file osdn-diag writes"):
        check_file_name(name, "manifest.json")


def test_verify_files_does_not_look_outside_the_run(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x").write_bytes(b"data")
    entry = {"sha256": hashlib.sha256(b"data").hexdigest(), "size": 4}
    run = tmp_path / "run"
    (run / "capture").mkdir(parents=True)
    problem = verify_files(run, {"capture/../../outside/x": entry})
    assert problem is not None and "not the name of a file osdn-diag writes" in problem


def test_the_capture_reader_refuses_a_shard_name_outside_the_capture(tmp_path):
    from osdn_diag.capture.store import CaptureReader

    run = _run(tmp_path / "run")
    (tmp_path / "n0").mkdir()
    (tmp_path / "n0" / "x").write_bytes(b"shard")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["shards"] = {"capture/../../n0/x": manifest["shards"][SHARD]}
    (run / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RunDirectoryError, match="lists 'capture/../../n0/x', not the name of a file"):
        CaptureReader(run)


# What --overwrite removes.

def test_overwrite_removes_the_shards_an_interrupted_capture_never_listed(tmp_path):
    run = _run(tmp_path / "run", shards={})  # killed before finish(): its shards are not listed
    (run / "capture" / "batch_00000" / "layer_001_call1.safetensors").write_bytes(b"x")
    (run / "capture" / "batch_00003").mkdir()
    (run / "capture" / "batch_00003" / ".layer_000.safetensors.abcd1234.tmp").write_bytes(b"half")
    prepare_output(run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == []


def test_overwrite_killed_half_way_leaves_a_run_that_says_it_is_unfinished(tmp_path, monkeypatch):
    """A command killed while --overwrite removes the old run (SIGKILL: no clean-up runs) leaves a
    manifest saying the run is not complete and listing no shard, so the next --overwrite replaces it;
    never the run's files without a manifest, which is refused as "not a run" even with --overwrite."""
    import osdn_diag.rundir as rundir

    run = _run(tmp_path / "run")
    (run / "summary.json").write_text("{}")
    remove = rundir.remove_run_files

    def killed(out_dir):
        (Path(out_dir) / SHARD).unlink()  # one file gone, then the process dies
        raise SystemExit("killed")

    monkeypatch.setattr(rundir, "remove_run_files", killed)
    with pytest.raises(SystemExit):
        prepare_output(run, overwrite=True)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["shards"] == {}
    assert not any(manifest["stages"].values())
    monkeypatch.setattr(rundir, "remove_run_files", remove)
    prepare_output(run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == []


@pytest.mark.parametrize("foreign", ["capture/experiment1.csv", "capture/batch_00000/notes.txt",
                                     "capture/mine/layer_000.safetensors"])
def test_overwrite_refuses_a_foreign_file_in_capture_before_removing_anything(tmp_path, foreign):
    run = _run(tmp_path / "run")
    (run / foreign).parent.mkdir(parents=True, exist_ok=True)
    (run / foreign).write_text("mine")
    first = foreign if foreign.count("/") == 1 or "batch_" in foreign else "capture/mine"
    with pytest.raises(RunDirectoryError, match=f"{run / first}: not a file osdn-diag writes.*move it out of"):
        prepare_output(run, overwrite=True)
    assert (run / "manifest.json").is_file() and (run / SHARD).is_file() and (run / foreign).read_text() == "mine"


@pytest.mark.parametrize("foreign", ["residuals.parquet/notes.txt", "residuals.parquet/old/part-00000.parquet"])
def test_overwrite_refuses_a_foreign_file_in_a_table_directory_before_removing_anything(tmp_path, foreign):
    run = _run(tmp_path / "run")
    part = run / "residuals.parquet" / "part-00001.parquet"
    (run / foreign).parent.mkdir(parents=True, exist_ok=True)
    (run / foreign).write_text("mine")
    part.write_bytes(b"part")
    first = "/".join(foreign.split("/")[:2])
    with pytest.raises(RunDirectoryError, match=f"{run / first}: not a file osdn-diag writes.*move it out of"):
        prepare_output(run, overwrite=True)
    assert (run / "manifest.json").is_file() and (run / SHARD).is_file() and (run / foreign).read_text() == "mine"
    assert part.read_bytes() == b"part"
    (run / foreign).unlink()  # moved away: the run's own parts go with the rest
    if foreign.count("/") == 2:
        (run / foreign).parent.rmdir()
    prepare_output(run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == []


# Stages.

def test_starting_a_stage_undoes_it_and_every_later_stage(tmp_path):
    """A stage that starts again (a re-replay of a reported run) leaves itself and every stage after it
    not done, so the run is not complete until they finish again; earlier stages stay done."""
    from osdn_diag.rundir import finish_stage, start_stage

    manifest = {"run_id": "a" * 32, "stages": {"capture": True, "replay": True, "report": True}}
    start_stage(tmp_path, manifest, "replay")
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk["stages"] == {"capture": True, "replay": False, "report": False} and not on_disk["complete"]
    finish_stage(tmp_path, manifest, "replay")
    assert json.loads((tmp_path / "manifest.json").read_text())["complete"] is False  # the report is not redone
    finish_stage(tmp_path, manifest, "report")
    assert json.loads((tmp_path / "manifest.json").read_text())["complete"] is True
    start_stage(tmp_path, manifest, "capture")
    assert manifest["stages"] == {"capture": False, "replay": False, "report": False}


def test_a_run_that_needs_merging_is_never_complete(tmp_path):
    from osdn_diag.rundir import finish_stage

    manifest = {"run_id": "a" * 32, "stages": {"capture": False, "replay": False}, "merge_needed": True}
    finish_stage(tmp_path, manifest, "capture", "replay")
    assert json.loads((tmp_path / "manifest.json").read_text())["complete"] is False
    manifest["merge_needed"] = False
    finish_stage(tmp_path, manifest)
    assert json.loads((tmp_path / "manifest.json").read_text())["complete"] is True


def test_a_run_being_read_is_not_written_and_a_run_being_written_is_not_read(tmp_path):
    """`report A B --out CMP`, `view`, `what-if`'s source and `merge`'s nodes are read under a shared
    lock: a `replay A` (or `run --overwrite`) started meanwhile is refused at once instead of replacing
    the tables being read (a comparison report then mixed the old summary with the new per-token
    table), and a reader finds a run being written refused at once too. Readers share the lock; the
    last one removes the lock file (issue 44)."""
    import fcntl

    from osdn_diag.rundir import LOCK_FILE, RunDirectoryError, output_lock, reading_lock

    run = tmp_path / "run"
    run.mkdir()
    with reading_lock(run), reading_lock(run, run):  # readers share; one directory twice is one lock
        with pytest.raises(RunDirectoryError, match=rf"{run} is being read by another osdn-diag command; wait"):
            with output_lock(run):
                pytest.fail("written while read")
        assert (run / LOCK_FILE).exists()
    assert not (run / LOCK_FILE).exists()
    with open(run / LOCK_FILE, "w") as held:  # a writer in another process
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(f"{os.getpid()}\n")  # this process holds it, through another descriptor
        held.flush()
        with pytest.raises(RunDirectoryError, match=rf"{run} is in use by another osdn-diag command \(pid {os.getpid()}\), "
                                                    "which is writing into it"):
            with reading_lock(run):
                pytest.fail("read while written")
    with output_lock(run), reading_lock(run):  # what this process writes, it may read
        pass
    assert not (run / LOCK_FILE).exists()
    run.chmod(0o555)  # read-only: no lock file can be made, and none is needed
    try:
        with reading_lock(run):
            pass
    finally:
        run.chmod(0o755)


# A run directory this user cannot write: readers lock the lock file that is there read-only.

# chmod 0555 stops writes for a user, not for root (as tests may run): as root, opening the lock file
# for writing then fails as it does for a user who cannot write there (EACCES).
_AS_A_USER = """
import errno, os
from osdn_diag import rundir
if os.geteuid() == 0:
    _real_open_lock = rundir._open_lock
    def _open_lock(path, *, write=True):
        if write:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return _real_open_lock(path, write=write)
    rundir._open_lock = _open_lock
"""

def _as_a_user(monkeypatch) -> None:
    """``_AS_A_USER`` in this process (undone when the test ends)."""
    from osdn_diag import rundir

    monkeypatch.setattr(rundir, "_open_lock", rundir._open_lock)  # put back when the test ends
    exec(_AS_A_USER, {})


_MERGE_READ_ONLY = _AS_A_USER + """
import sys
sys.argv = ["osdn-diag", "merge", {node!r}, "--out", {out!r}]
from osdn_diag.cli import console
console()
"""


@pytest.mark.parametrize("kind", ["fifo", "link", "hard link"])
def test_a_lock_path_that_is_not_a_lock_file_in_a_read_only_run_is_refused(tmp_path, kind):
    """A reader that cannot write the run (a colleague's, a read-only mount) locks the lock file that
    is there through a read-only descriptor; that file is checked as a writer checks it. A FIFO, a
    link or a hard link planted as `.osdn-diag.lock` is refused in one line naming it (exit status
    2), left as it is, and the FIFO is never waited on; before, the read-only open took whatever was
    there (a link: no lock at all)."""
    import subprocess
    import sys

    node = tmp_path / "node"
    node.mkdir()
    lock = node / LOCK_FILE
    if kind == "fifo":
        os.mkfifo(lock, 0o444)
    elif kind == "link":
        lock.symlink_to(_secret(tmp_path))
    else:
        os.link(_secret(tmp_path), lock)
    node.chmod(0o555)
    out = tmp_path / "merged"
    try:
        done = subprocess.run([sys.executable, "-c", _MERGE_READ_ONLY.format(node=str(node), out=str(out))],
                              cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    finally:
        node.chmod(0o755)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"osdn-diag: error: {lock}: not a lock file osdn-diag made"), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert lock.is_symlink() if kind == "link" else stat.S_ISFIFO(lock.lstat().st_mode) if kind == "fifo" else \
        lock.stat().st_nlink == 2  # left alone
    assert not out.exists()


def test_a_read_only_run_is_read_under_the_lock_file_there(tmp_path, monkeypatch):
    """In a read-only run the lock file a writer holds is still seen (the reader is refused), and one
    no command holds is shared; with none there, no lock is taken (no command can write there either)."""
    import fcntl

    from osdn_diag.rundir import reading_lock

    _as_a_user(monkeypatch)
    run = tmp_path / "run"
    run.mkdir()
    run.chmod(0o555)
    try:
        with reading_lock(run), reading_lock(run):  # nothing there: nothing locked, nothing made
            assert not (run / LOCK_FILE).exists()
        run.chmod(0o755)
        (run / LOCK_FILE).write_text("")
        (run / LOCK_FILE).chmod(0o444)
        run.chmod(0o555)
        with reading_lock(run):
            other = os.open(run / LOCK_FILE, os.O_RDONLY)
            try:  # the file there is held shared
                with pytest.raises(BlockingIOError):
                    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(other)
        run.chmod(0o755)
        (run / LOCK_FILE).write_text("")  # removed by the last reader where it could be (as root)
        run.chmod(0o555)
        with open(run / LOCK_FILE) as held:  # a writer holds it
            fcntl.flock(held, fcntl.LOCK_EX)
            with pytest.raises(RunDirectoryError, match=f"{run} is in use by another osdn-diag command"):
                with reading_lock(run):
                    pytest.fail("read while written")
    finally:
        run.chmod(0o755)


# Who holds a lock.

_HOLD = """
import fcntl, sys
from osdn_diag.rundir import reading_lock
if sys.argv[2] == "reader":
    with reading_lock(sys.argv[1]):
        print("held", flush=True)
        sys.stdin.read()
else:  # a writer that has the lock but has not written its pid yet
    with open(sys.argv[1] + "/.osdn-diag.lock", "r+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        print("held", flush=True)
        sys.stdin.read()
"""


def _dead_pid() -> int:
    import subprocess
    import sys

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


@pytest.mark.parametrize("holder", ["reader", "writer"])
def test_a_refusal_never_names_a_pid_that_does_not_hold_the_lock(tmp_path, holder):
    """A killed writer's pid stays in the lock file; readers write none, and a writer that has just
    got the lock has not written its own yet. A command refused then named the dead pid as the one
    in its way. Now a writer refused by readers says the run is being read; a command refused by a
    writer whose pid is not known says it is being written, naming no pid."""
    import subprocess
    import sys

    from osdn_diag.rundir import reading_lock

    run = tmp_path / "run"
    run.mkdir()
    stale = _dead_pid()
    (run / LOCK_FILE).write_text(f"{stale}\n")  # a writer killed with SIGKILL left it
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(run), holder], cwd=Path(__file__).resolve().parents[1],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "held\n"
        with pytest.raises(RunDirectoryError) as refused:
            with output_lock(run):
                pytest.fail("written while held")
        if holder == "reader":
            assert str(refused.value) == f"{run} is being read by another osdn-diag command; wait for it to finish"
        else:
            assert str(refused.value) == (f"{run} is in use by another osdn-diag command, which is writing into it; "
                                          "wait for it to finish")
            with pytest.raises(RunDirectoryError) as refused_reader:
                with reading_lock(run):
                    pytest.fail("read while written")
            assert str(refused_reader.value) == str(refused.value)
        assert str(stale) not in str(refused.value)
    finally:
        proc.communicate("")
    assert proc.returncode == 0


# Which process locks.

def test_a_stray_rank_in_a_single_process_environment_still_locks(tmp_path, monkeypatch):
    """A ``RANK`` left in the environment of one process (``WORLD_SIZE`` unset: no launcher, no group)
    made the process take no lock ("only rank 0 locks"), so it wrote into a directory another command
    held. Only a group a launcher describes (``WORLD_SIZE`` > 1) or one joined decides the rank: a
    process of its own is rank 0 and locks, and a directory another holds is refused."""
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "1")
    with open(run / LOCK_FILE, "w") as held:  # another command writing into it
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(RunDirectoryError, match="in use by another osdn-diag command"):
            with output_lock(run):
                pytest.fail("written while another command holds the lock")
    with output_lock(run):  # free again: taken, so that a second writer is refused
        with open(run / LOCK_FILE) as second:
            with pytest.raises(BlockingIOError):
                fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
    # torchrun's other ranks (WORLD_SIZE > 1, before the group is joined) still leave it to rank 0
    monkeypatch.setenv("WORLD_SIZE", "2")
    with open(run / LOCK_FILE, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with output_lock(run):
            pass


@pytest.mark.parametrize("name, refused", [
    ("summary.json", "one of the files of the run"), ("manifest.json", "one of the files of the run"),
    (LOCK_FILE, "one of the files of the run"), (SHARD, "inside capture/ of the run"),
    ("capture/batch_00000/notes.html", "inside capture/ of the run"), ("plots/view.html", "inside plots/ of the run"),
    ("view.html", None), ("notes/view.html", None),
])
def test_a_file_named_on_its_own_is_refused_among_a_runs_files(tmp_path, name, refused):
    """``view --out``/``prove --json``: one of a run's own files, or a path below one, is refused
    (:func:`~osdn_diag.rundir.check_file_placement`); a new file beside them is fine. Writes nothing."""
    from osdn_diag.rundir import check_file_placement

    run = _run(tmp_path / "run")
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    if refused is None:
        check_file_placement(run / name)
    else:
        with pytest.raises(RunDirectoryError, match=f"^--out {run / name}: {refused} {run.resolve()}"):
            check_file_placement(run / name)
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before


def test_a_comparison_reports_files_are_refused_as_a_file_named_on_its_own(tmp_path):
    from osdn_diag.rundir import check_file_placement

    cmp = tmp_path / "cmp"
    cmp.mkdir()
    (cmp / "manifest.json").write_text(json.dumps({"kind": "report", "report_of": []}))
    for name in ("report.md", "plots/q_geo.png", "manifest.json"):
        with pytest.raises(RunDirectoryError, match="of the comparison report"):
            check_file_placement(cmp / name)
    check_file_placement(cmp / "view.html")
