"""``osdn-diag merge`` (:mod:`osdn_diag.merge`) on nodes' directories built here (the files' bytes
stand in for shards and table parts: merging checks and copies them, it does not read them): it takes
OUT's lock, refuses everything it would refuse before removing an old run, copies no file outside OUT
whatever the manifest names, and touches nothing beside OUT (issue 44). The merge of a real two-node
run is in tests/pipeline/test_multinode.py."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import pytest

from osdn_diag.cli import entry
from osdn_diag.merge import merge_runs
from osdn_diag.rundir import LOCK_FILE

RUN_ID = "a" * 32
#: rank 0's summary.json: the keys every summary has, of the types osdn-diag writes
SUMMARY = {"q_geo": 0.5, "q_arith": 0.6, "n": 1, "by_layer": {"000": {"q_geo": 0.5, "q_arith": 0.6, "n": 1}},
           "fidelity": {"max_rel_error": None},
           "position_bins": {"edges": [0.0, 1.0], "q_geo": [0.5], "q_arith": [0.6], "n": [1]}}


def _entry(data: bytes) -> dict:
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _nodes(root: Path, shards: dict | None = None, run_id: str = RUN_ID) -> list[Path]:
    """Two nodes' --out of a finished run of two processes: rank 0's holds the manifest."""
    nodes = [root / "node0", root / "node1"]
    listed, parts = {}, {}
    for rank, node in enumerate(nodes):
        shard, part = f"capture/batch_0000{rank}/layer_000.safetensors", f"residuals.parquet/part-0000{rank}.parquet"
        for name, table in ((shard, listed), (part, parts)):
            data = f"{name} of rank {rank} of run {run_id}".encode()
            _write(node / name, data)
            table[name] = _entry(data)
        _write(node / "ranks" / f"rank-0000{rank}.json",
               json.dumps({"run_id": run_id, "rank": rank, "world_size": 2}).encode())
    manifest = {"run_id": run_id, "stages": {"capture": True, "replay": True, "report": False}, "complete": False,
                "world_size": 2, "shared_out": False, "merge_needed": True,
                "shards": listed if shards is None else shards, "parts": parts}
    _write(nodes[0] / "manifest.json", json.dumps(manifest).encode())
    _write(nodes[0] / "summary.json", json.dumps({**SUMMARY, "run_id": run_id}).encode())
    return nodes


def _one_line(argv, capsys) -> str:
    capsys.readouterr()
    assert entry(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("osdn-diag: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_merge_assembles_the_run(tmp_path):
    out = merge_runs(_nodes(tmp_path), tmp_path / "m", report=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stages"] == {"capture": True, "replay": True, "report": False} and not manifest["complete"]
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "capture/batch_00000/layer_000.safetensors", "capture/batch_00001/layer_000.safetensors", "manifest.json",
        "ranks/rank-00000.json", "ranks/rank-00001.json", "residuals.parquet/part-00000.parquet",
        "residuals.parquet/part-00001.parquet", "summary.json"]


def _edit_manifest(node: Path, **changes) -> None:
    path = node / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("case", ["capture-unfinished", "replay-unfinished", "one-process", "last-rank-missing",
                                  "record-of-another-run"])
def test_a_run_that_is_not_whole_is_refused_before_out_exists(tmp_path, capsys, case):
    """Merging needs a run of several processes whose capture and replay finished, with a record of
    every rank of that run (the module's docstring): anything else is refused in one line naming what
    is missing, and OUT is never made."""
    nodes = _nodes(tmp_path)
    stages = {"capture": True, "replay": True, "report": False}
    if case == "capture-unfinished":
        _edit_manifest(nodes[0], stages={**stages, "capture": False})
    elif case == "replay-unfinished":
        _edit_manifest(nodes[0], stages={**stages, "replay": False})
    elif case == "one-process":
        _edit_manifest(nodes[0], world_size=1)
    elif case == "last-rank-missing":
        (nodes[1] / "ranks" / "rank-00001.json").unlink()
    else:
        (nodes[1] / "ranks" / "rank-00001.json").write_text(
            json.dumps({"run_id": "b" * 32, "rank": 1, "world_size": 2}))
    out = tmp_path / "m"
    err = _one_line(["merge", *map(str, nodes), "--out", str(out)], capsys)
    want = {"capture-unfinished": "the run did not finish (stages.capture is not true)",
            "replay-unfinished": "the run did not finish (stages.replay is not true)",
            "one-process": "not a run of several processes (world_size 1)",
            "last-rank-missing": f"rank 1: no ranks/rank-00001.json of run {RUN_ID}",
            "record-of-another-run": f"rank-00001.json: of run {'b' * 32}, not of {RUN_ID}"}[case]
    assert want in err, err
    assert not out.exists()


def test_a_merge_into_a_directory_in_use_is_refused(tmp_path, capsys):
    """Two merges into one OUT at once: the second is refused at once (the lock), not interleaved."""
    nodes = _nodes(tmp_path)
    out = tmp_path / "m"
    out.mkdir()
    with open(out / LOCK_FILE, "w") as held:  # another command holds OUT's lock
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(f"{os.getpid()}\n")  # this process holds it, through another descriptor
        held.flush()
        err = _one_line(["merge", *map(str, nodes), "--out", str(out)], capsys)
        assert f"{out} is in use by another osdn-diag command (pid {os.getpid()})" in err, err
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]


def test_overwrite_refuses_before_it_removes_the_old_run(tmp_path, capsys):
    nodes = _nodes(tmp_path)
    out = merge_runs(nodes, tmp_path / "m", report=False)
    (out / "capture" / "notes.csv").write_text("mine")
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    err = _one_line(["merge", *map(str, nodes), "--out", str(out), "--overwrite"], capsys)
    assert str(out / "capture" / "notes.csv") in err and "move it out of" in err, err
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before  # the old run is whole


def test_overwrite_replaces_a_run_beside_a_lock_a_killed_command_left(tmp_path):
    nodes = _nodes(tmp_path)
    out = merge_runs(nodes, tmp_path / "m", report=False)
    (out / LOCK_FILE).write_text("12345\n")  # its holder was killed: the file stays, the flock does not
    (out / "notes.txt").write_text("mine")  # a file a run never writes stays, as for run
    merge_runs(nodes, out, overwrite=True, report=False)
    assert json.loads((out / "manifest.json").read_text())["stages"]["replay"] is True
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("key,value", [("shards", None), ("parts", "x"), ("shards", {"capture/batch_00000/layer_000.safetensors": "bad"}),
                                       ("tokens", {"sha256": "ab"}), ("files", {"summary.json": "x"}), ("files", [1])])
def test_a_damaged_node_manifest_is_refused_naming_it_before_out_exists(tmp_path, capsys, key, value):
    """Rank 0's manifest is checked as every command checks a manifest it reads (its keys' types): a
    damaged one is refused in one line naming that file and the key, not OUT's manifest after a copy."""
    nodes = _nodes(tmp_path)
    _edit_manifest(nodes[0], **{key: value})
    out = tmp_path / "m"
    err = _one_line(["merge", *map(str, nodes), "--out", str(out)], capsys)
    assert f"{nodes[0] / 'manifest.json'}: key {key!r}" in err or f"{nodes[0] / 'manifest.json'}: key '{key}." in err, err
    assert not out.exists()


def test_a_damaged_summary_of_rank_0_is_refused_naming_it_before_out_exists(tmp_path, capsys):
    """OUT's report reads rank 0's summary.json: checked (its keys' types) before anything is copied,
    and refused naming that file, not OUT's copy after a merge the report then refuses."""
    nodes = _nodes(tmp_path)
    (nodes[0] / "summary.json").write_text(json.dumps({**SUMMARY, "run_id": RUN_ID, "position_bins": None}))
    out = tmp_path / "m"
    err = _one_line(["merge", *map(str, nodes), "--out", str(out)], capsys)
    assert f"{nodes[0] / 'summary.json'}: key 'position_bins' should be an object" in err, err
    assert not out.exists()


@pytest.mark.parametrize("overwrite", [False, True], ids=["new-out", "overwrite"])
def test_a_summary_of_another_run_is_refused_naming_it_before_out_changes(tmp_path, capsys, overwrite):
    """Rank 0's summary.json (well formed, even recorded in its manifest) of another run is refused
    naming it before OUT changes: with --overwrite the complete run there stays as it was."""
    nodes = _nodes(tmp_path)
    out = tmp_path / "m"
    if overwrite:
        merge_runs(nodes, out, report=False)
        before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    (nodes[0] / "summary.json").write_text(json.dumps({**SUMMARY, "run_id": "f" * 32}))
    argv = ["merge", *map(str, nodes), "--out", str(out)] + (["--overwrite"] if overwrite else [])
    err = _one_line(argv, capsys)
    assert f"{nodes[0] / 'summary.json'}: of run {'f' * 32}, not of {RUN_ID}" in err, err
    if overwrite:
        assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    else:
        assert not out.exists()


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "other"])
def test_a_manifest_name_outside_the_layout_is_refused_and_nothing_written(tmp_path, capsys, kind):
    name = {"dotdot": "capture/../../n0/x", "absolute": str(tmp_path / "abs" / "x"),
            "other": "capture/batch_00000/x.py"}[kind]
    data = b"payload"
    nodes = _nodes(tmp_path / "nodes", shards={name: _entry(data)})
    for node in nodes:  # wherever the name resolves from a node's directory, the bytes are there
        _write(Path(os.path.normpath(node / name)), data)
    out = tmp_path / "deep" / "er" / "m"
    err = _one_line(["merge", *map(str, nodes), "--out", str(out)], capsys)
    assert "not the name of a file osdn-diag writes" in err and repr(name) in err, err
    assert not out.exists()
    assert not (tmp_path / "deep" / "n0").exists()  # out/capture/../../n0/x


def test_an_out_with_glob_characters_touches_nothing_beside_it(tmp_path):
    nodes = _nodes(tmp_path)
    beside = tmp_path / ".x1.merging-keep"  # what the glob of `.x[1].merging-*` matched
    beside.mkdir()
    (beside / "data").write_text("mine")
    merge_runs(nodes, tmp_path / "x[1]", report=False)
    assert (beside / "data").read_text() == "mine"
    assert (tmp_path / "x[1]" / "manifest.json").is_file()


def test_merge_refuses_a_link_in_out(tmp_path):
    nodes = _nodes(tmp_path)
    out = merge_runs(nodes, tmp_path / "m", report=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    import shutil

    shutil.rmtree(out / "ranks")
    (out / "ranks").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match="ranks: a symbolic link"):
        merge_runs(nodes, out, overwrite=True, report=False)
    assert list(elsewhere.iterdir()) == [] and (out / "manifest.json").is_file()


@pytest.mark.parametrize("name", ["summary.json", "comparator.parquet"])
def test_a_result_edited_after_the_run_is_refused_before_out_exists(tmp_path, capsys, name):
    """rank 0's summary.json and comparator.parquet are checked against the sha256 its manifest records
    before anything is written: an edited summary is never assembled into a run (which only its report
    would then have refused, naming the merged copy)."""
    nodes = _nodes(tmp_path)
    _write(nodes[0] / "comparator.parquet", b"comparator of rank 0")
    manifest = json.loads((nodes[0] / "manifest.json").read_text())
    manifest["files"] = {n: _entry((nodes[0] / n).read_bytes()) for n in ("summary.json", "comparator.parquet")}
    _write(nodes[0] / "manifest.json", json.dumps(manifest).encode())
    merge_runs(nodes, tmp_path / "whole", report=False)  # as recorded: merged
    (nodes[0] / name).write_bytes((nodes[0] / name).read_bytes() + b" ")
    out = tmp_path / "m"
    err = _one_line(["merge", *map(str, nodes), "--out", str(out)], capsys)
    assert f"{nodes[0] / name}: its size or sha256 differs" in err, err
    assert not out.exists()


def test_a_node_directory_another_command_writes_into_is_refused(tmp_path):
    """A merge reads and copies the nodes' files while nothing writes into them: a node directory whose
    lock another command holds (a `run --overwrite` removing its shards, say) is refused at once, and
    nothing is written; before, its files were checked, then copied as they were being replaced
    (issue 44)."""
    from osdn_diag.rundir import RunDirectoryError

    nodes = _nodes(tmp_path)
    with open(nodes[1] / LOCK_FILE, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(f"{os.getpid()}\n")  # this process holds it, through another descriptor
        held.flush()
        with pytest.raises(RunDirectoryError, match=rf"{nodes[1]} is in use by another osdn-diag command "
                                                    rf"\(pid {os.getpid()}\), which is writing into it"):
            merge_runs(nodes, tmp_path / "m", report=False)
    assert not (tmp_path / "m").exists()
    merge_runs(nodes, tmp_path / "m", report=False)  # once it is free
    assert not any((node / LOCK_FILE).exists() for node in nodes[:1])


# Ctrl-C and SIGTERM during a merge.

# `osdn-diag merge`, signalled at a chosen moment: "start", as OUT's lock has just been taken (nothing
# written yet); "copy", once two of the run's files have been copied; "swap", as the copied run takes
# the place of the one OUT held.
MERGE_SCRIPT = """
import contextlib, os, signal, sys
from osdn_diag import cli, merge

moment, sig = {moment!r}, getattr(signal, {sig!r})
if moment == "start":
    real_lock = merge.output_lock

    @contextlib.contextmanager
    def output_lock(directory):
        with real_lock(directory):
            os.kill(os.getpid(), sig)
            yield

    merge.output_lock = output_lock
elif moment == "swap":  # the old run's files about to be removed, the new ones all copied
    real_remove = merge.remove_run_files

    def remove_run_files(out):
        os.kill(os.getpid(), sig)
        real_remove(out)

    merge.remove_run_files = remove_run_files
elif moment == "copy":
    real_copy, copied = merge._copy, []

    def _copy(*args):
        real_copy(*args)
        copied.append(args)
        if len(copied) == 2:
            os.kill(os.getpid(), sig)

    merge._copy = _copy
sys.argv = ["osdn-diag", "merge", *{argv!r}]
cli.console()
"""


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path below ``root`` and its bytes (``None``: a directory)."""
    return {p.relative_to(root).as_posix(): None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


def _no_report(nodes: list[Path]) -> list[Path]:
    """The run without a report stage: its merge is complete once the files are in (its bytes stand in
    for shards and tables, which a report would read)."""
    _edit_manifest(nodes[0], stages={"capture": True, "replay": True})
    return nodes


@pytest.mark.parametrize("moment", ["start", "copy"])
@pytest.mark.parametrize("old_run", [False, True], ids=["new-out", "overwrite"])
@pytest.mark.parametrize("sig,status,line", [("SIGTERM", 143, "osdn-diag: terminated (SIGTERM)\n"),
                                             ("SIGINT", 130, "osdn-diag: interrupted\n")], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_a_merge_leaves_out_as_it_was(tmp_path, capsys, sig, status, line, old_run, moment):
    """SIGTERM (a job cancelled) or Ctrl-C as a merge takes OUT's lock or while it copies the files:
    the command ends with its one line and status, and OUT is as the merge found it — absent, or the
    complete run it held (`--overwrite`), file for file — with no lock left on OUT or the nodes and
    nothing that looks like a run, complete or not; the same merge run again succeeds. Before, a
    merge stopped while copying left an incomplete run in OUT (and had already removed the old one),
    which the same command then refused."""
    import subprocess
    import sys

    nodes = _no_report(_nodes(tmp_path / "new"))
    out = tmp_path / "m"
    argv = [*map(str, nodes), "--out", str(out)]
    if old_run:
        merge_runs(_no_report(_nodes(tmp_path / "old", run_id="b" * 32)), out, report=False)
        assert json.loads((out / "manifest.json").read_text())["complete"] is True
        argv.append("--overwrite")
    before = _tree(out) if out.exists() else None
    nodes_before = [_tree(node) for node in nodes]
    env = {**os.environ, "OSDN_DIAG_REPORT_WORKERS": "0"}
    done = subprocess.run([sys.executable, "-c", MERGE_SCRIPT.format(moment=moment, sig=sig, argv=argv)],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == status, done.stderr
    assert done.stderr == line
    assert (_tree(out) if out.exists() else None) == before  # no lock, no temporary, no partial run
    assert [_tree(node) for node in nodes] == nodes_before  # the nodes only read, their locks gone
    assert _one_success(argv, capsys)["run_id"] == RUN_ID  # the same merge again


def _one_success(argv: list[str], capsys) -> dict:
    capsys.readouterr()
    assert entry(["merge", *argv]) == 0, capsys.readouterr().err
    out = Path(argv[argv.index("--out") + 1])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True and not (out / LOCK_FILE).exists()
    return manifest


@pytest.mark.parametrize("sig,status,line", [("SIGTERM", 143, "osdn-diag: terminated (SIGTERM)\n"),
                                             ("SIGINT", 130, "osdn-diag: interrupted\n")], ids=["SIGTERM", "SIGINT"])
def test_a_signal_as_the_merged_run_replaces_the_old_one_waits_for_the_new_run(tmp_path, sig, status, line):
    """Once every file is copied, the old run's files are removed and the new ones renamed in: a
    signal then is held back until OUT holds the whole new run, complete, and ends the command after
    it, with its line and status and no lock left."""
    import subprocess
    import sys

    nodes = _no_report(_nodes(tmp_path / "new"))
    out = tmp_path / "m"
    merge_runs(_no_report(_nodes(tmp_path / "old", run_id="b" * 32)), out, report=False)
    argv = [*map(str, nodes), "--out", str(out), "--overwrite"]
    done = subprocess.run([sys.executable, "-c", MERGE_SCRIPT.format(moment="swap", sig=sig, argv=argv)],
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OSDN_DIAG_REPORT_WORKERS": "0"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr
    assert done.stderr == line
    merged = tmp_path / "again"
    merge_runs(nodes, merged, report=False)
    expected = _tree(merged)
    expected["manifest.json"] = (merged / "manifest.json").read_bytes().replace(str(merged).encode(), str(out).encode())
    assert _tree(out) == expected  # the new run, whole, and nothing else (its merged_from aside)
    assert json.loads((out / "manifest.json").read_text())["complete"] is True


def test_a_killed_merge_leaves_the_old_run_and_the_next_merge_clears_its_copies(tmp_path, capsys):
    """SIGKILL (out of memory) while the files are copied: nothing cleans up, but the run OUT held is
    intact beside the copies (a hidden directory) and the lock file; the next merge into OUT takes the
    lock over and removes them."""
    import subprocess
    import sys

    nodes = _no_report(_nodes(tmp_path / "new"))
    out = tmp_path / "m"
    merge_runs(_no_report(_nodes(tmp_path / "old", run_id="b" * 32)), out, report=False)
    before = _tree(out)
    argv = [*map(str, nodes), "--out", str(out), "--overwrite"]
    done = subprocess.run([sys.executable, "-c", MERGE_SCRIPT.format(moment="copy", sig="SIGKILL", argv=argv)],
                          cwd=Path(__file__).resolve().parents[1], env={**os.environ, "OSDN_DIAG_REPORT_WORKERS": "0"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -9, done.stderr
    left = {name for name in _tree(out) if "/" not in name} - set(before)
    assert len(left) == 2 and LOCK_FILE in left and next(iter(left - {LOCK_FILE})).startswith(".osdn-diag-merge.")
    assert {k: v for k, v in _tree(out).items() if k.split("/")[0] not in left} == before  # the old run, whole
    assert _one_success(argv, capsys)["run_id"] == RUN_ID
    assert not any(p.name.startswith(".osdn-diag-merge.") for p in out.iterdir())


def test_overwrite_by_a_run_removes_the_copies_a_killed_merge_left_and_nothing_else(tmp_path, capsys):
    """A merge killed outright (SIGKILL) leaves its copies in OUT (``.osdn-diag-merge.XXXXXXXX``, as in
    the test above); `osdn-diag capture|run ... --out OUT --overwrite` kept them, only a later merge
    removed them. The command that replaces OUT's run removes them too: only real directories of the
    staging name — a link of that name (and what it points to), a name that is not quite it and the
    user's other files stay. (The copies are made here as the merge makes them: the test above kills
    a merge to show they are left.)"""
    import tempfile

    from osdn_diag.rundir import MERGE_STAGING_PREFIX

    out = tmp_path / "m"
    merge_runs(_no_report(_nodes(tmp_path / "old", run_id="b" * 32)), out, report=False)
    killed = Path(tempfile.mkdtemp(prefix=MERGE_STAGING_PREFIX, dir=out))  # as the merge makes it
    _write(killed / "capture" / "batch_00000" / "layer_000.safetensors", b"a copied shard")
    elsewhere = tmp_path / "elsewhere"
    _write(elsewhere / "keep.txt", b"the user's")
    (out / ".osdn-diag-merge.abcd1234").symlink_to(elsewhere, target_is_directory=True)
    _write(out / ".osdn-diag-merge.notours" / "x", b"not a merge's name")
    _write(out / "notes.txt", b"the user's")
    assert entry(["capture", "random:deltanet-tiny", "--prompts", "random", "--num-prompts", "1", "--length", "4",
                  "--out", str(out), "--overwrite", "--device", "cpu", "-q"]) == 0, capsys.readouterr().err
    assert not killed.exists()
    assert sorted(p.name for p in out.iterdir()) == [".osdn-diag-merge.abcd1234", ".osdn-diag-merge.notours",
                                                     "capture", "manifest.json", "notes.txt", "tokens.parquet"]
    assert (out / ".osdn-diag-merge.abcd1234").is_symlink() and (elsewhere / "keep.txt").read_bytes() == b"the user's"
    assert json.loads((out / "manifest.json").read_text())["complete"] is True
