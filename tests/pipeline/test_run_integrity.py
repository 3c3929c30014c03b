"""A run directory is a unit: one run id in the manifest, every shard and every table; the capture
is exactly the shards the manifest lists (by name, size and sha256); ``"complete": true`` only once
every stage a command set out to do has finished; an existing run is replaced only with
``--overwrite``, and only once the new command's inputs have loaded.

Each test is one scenario of the reported failures (issue 18), on a tiny random model.

Kernels: the default ``kernels="auto"``, so on a CPU the reference recurrence stands in for fla's kernel;
test_fla_kernels_e2e.py runs fla's own kernels end to end.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pyarrow.parquet as pq
import pytest
from safetensors import safe_open

from osdn_diag.cli import entry, main
from osdn_diag.report.markdown import load_run

MODEL = "random:deltanet-tiny"


def _args(out, num_prompts=2, *extra, model=MODEL, command="run"):
    return [command, model, "--prompts", "random", "--num-prompts", str(num_prompts), "--length", "16",
            "--out", str(out), "-q", *extra]


def _manifest(run):
    return json.loads((run / "manifest.json").read_text())


def _summary(run):
    return json.loads((run / "summary.json").read_text())


def _shards(run):
    return sorted(p.relative_to(run).as_posix() for p in (run / "capture").rglob("*") if p.is_file())


def _files(run):
    """Every file of a run directory with its bytes (to check that a refused command left it alone)."""
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _one_line_error(argv, capsys) -> str:
    """Run the console command; it must fail with status 2 and one line on stderr, no traceback."""
    capsys.readouterr()
    assert entry(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("osdn-diag: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs, captured and replayed (4 prompts, seed 0; 2 prompts, seed 1; no report, which takes
    longer than the rest); tests copy them before changing anything."""
    root = tmp_path_factory.mktemp("runs")
    for name, n, seed in (("four", 4, "0"), ("two", 2, "1")):
        assert main(_args(root / name, n, "--seed", seed, command="capture")) == 0
        assert main(["replay", str(root / name), "-q"]) == 0
    return root


def _copy(runs, name, tmp_path):
    return shutil.copytree(runs / name, tmp_path / name)


# 1. A second run into an existing run directory.

def test_a_second_run_into_a_run_directory_is_refused_and_overwrite_replaces_it(runs, tmp_path, capsys):
    run = _copy(runs, "four", tmp_path)
    before = _files(run)
    err = _one_line_error(_args(run, 2, "--seed", "1"), capsys)
    assert str(run) in err and "--overwrite" in err
    assert _files(run) == before  # the first run is untouched
    # With --overwrite the old run's files are gone: n is the 2-prompt run's, not 4 + 2 prompts' worth.
    assert main(_args(run, 2, "--seed", "1", "--overwrite")) == 0
    fresh = runs / "two"
    assert _summary(run)["n"] == _summary(fresh)["n"] == 2 * 2 * 2 * 16
    assert _shards(run) == _shards(fresh) and len(_manifest(run)["prompts"]) == 2
    assert _summary(run)["q_geo"] == _summary(fresh)["q_geo"]


def test_another_model_over_a_run_reports_only_its_own_prompts(runs, tmp_path):
    run = _copy(runs, "four", tmp_path)
    assert main(_args(run, 2, "--overwrite", model="random:gated-deltanet-tiny", command="capture")) == 0
    manifest = _manifest(run)
    assert manifest["model"]["spec"] == "random:gated-deltanet-tiny" and len(manifest["prompts"]) == 2
    assert len(_shards(run)) == len(manifest["shards"]) == 2 * 2  # batches × layers, none of the old run
    for name in ("residuals.parquet", "comparator.parquet", "summary.json", "report.md"):
        assert not (run / name).exists(), name  # the old run's results went with it
    with pytest.raises(RuntimeError, match="replay"):
        main(["report", str(run)])


# 3. Shards are tied to the manifest.

def test_every_file_carries_the_run_id(runs):
    run = runs / "four"
    run_id = _manifest(run)["run_id"]
    assert len(run_id) == 32 and int(run_id, 16) >= 0
    for shard in _manifest(run)["shards"]:
        with safe_open(str(run / shard), framework="pt") as fh:
            assert fh.metadata()["run_id"] == run_id
    assert _summary(run)["run_id"] == run_id
    for table in ("residuals.parquet", "comparator.parquet"):
        assert pq.read_schema(run / table).metadata[b"osdn_diag.run_id"].decode() == run_id
    assert _manifest(runs / "two")["run_id"] != run_id


def test_a_deleted_shard_is_refused(runs, tmp_path, capsys):
    run = _copy(runs, "four", tmp_path)
    victim = run / "capture" / "batch_00002" / "layer_001.safetensors"
    victim.unlink()
    tables = {n: (run / n).read_bytes() for n in ("summary.json", "residuals.parquet")}
    err = _one_line_error(["replay", str(run), "-q"], capsys)
    assert str(victim) in err and "missing" in err
    assert {n: (run / n).read_bytes() for n in tables} == tables


def test_a_shard_copied_in_from_another_run_is_refused(runs, tmp_path, capsys):
    run = _copy(runs, "four", tmp_path)
    name = "capture/batch_00001/layer_000.safetensors"
    shutil.copy(runs / "two" / name, run / name)  # same name, another run's data
    err = _one_line_error(["replay", str(run), "-q"], capsys)
    assert str(run / name) in err and "sha256" in err


def test_an_extra_shard_is_refused(runs, tmp_path, capsys):
    run = _copy(runs, "two", tmp_path)
    name = "capture/batch_00003/layer_000.safetensors"
    (run / name).parent.mkdir()
    shutil.copy(runs / "four" / name, run / name)
    err = _one_line_error(["replay", str(run), "-q"], capsys)
    assert str(run / name) in err and "not part of this run" in err
    # and what-if, which reads the same capture
    err = _one_line_error(["what-if", str(run), "-q", "--out", str(tmp_path / "wi")], capsys)
    assert str(run / name) in err and not (tmp_path / "wi").exists()


def test_report_refuses_tables_of_another_run(runs, tmp_path, capsys):
    for name in ("summary.json", "residuals.parquet", "comparator.parquet"):
        run = shutil.copytree(runs / "four", tmp_path / name)
        shutil.copy(runs / "two" / name, run / name)
        err = _one_line_error(["report", str(run)], capsys)
        assert str(run / name) in err and "run id" in err, err


# 4. A run killed during replay is not complete, and report refuses it.

@pytest.fixture
def replay_crashes(monkeypatch):
    from osdn_diag.replay.replayer import Replayer

    def crash(self, stored, **kwargs):
        raise RuntimeError("simulated crash during replay")

    monkeypatch.setattr(Replayer, "add", crash)


def test_a_run_killed_during_replay_is_not_complete(tmp_path, replay_crashes):
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(_args(tmp_path / "run", 2))
    manifest = _manifest(tmp_path / "run")
    assert manifest["complete"] is False
    assert manifest["stages"] == {"capture": True, "replay": False, "report": False}
    with pytest.raises(RuntimeError, match="replay did not finish"):
        main(["report", str(tmp_path / "run")])


def test_a_rerun_killed_during_replay_does_not_show_the_old_numbers(runs, tmp_path, replay_crashes, capsys):
    run = _copy(runs, "four", tmp_path)
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(_args(run, 4, "--seed", "1", "--overwrite"))
    assert _manifest(run)["complete"] is False and _manifest(run)["seed"] == 1
    assert not (run / "summary.json").exists() and not (run / "residuals.parquet").exists()
    err = _one_line_error(["report", str(run)], capsys)
    assert "replay did not finish" in err


# 5. what-if onto its own input.

@pytest.mark.parametrize("where", [".", "capture", "capture/batch_00000"])
def test_what_if_refuses_to_write_over_its_input(runs, tmp_path, capsys, where):
    run = _copy(runs, "two", tmp_path)
    before = _files(run)
    err = _one_line_error(["what-if", str(run), "--out", str(run / where), "-q"], capsys)
    assert "--out" in err and str(run) in err
    assert _files(run) == before


def _sha256s(run):
    """sha256 of every file of a run directory, by relative path (written here with hashlib)."""
    return {name: hashlib.sha256(data).hexdigest() for name, data in _files(run).items()}


@pytest.mark.parametrize("spelling", ["itself", "dot", "dotdot", "symlink", "relative"])
def test_what_if_with_overwrite_still_refuses_its_own_input(runs, tmp_path, capsys, monkeypatch, spelling):
    """--overwrite replaces an existing run; it must never make the run what-if reads its output. Every
    way of naming the input directory as --out is refused before anything is written, and the input
    keeps every file, byte for byte."""
    from osdn_diag.rundir import RunDirectoryError
    from osdn_diag.whatif import WhatIf, what_if_run

    run = _copy(runs, "two", tmp_path)
    out = {
        "itself": run,
        "dot": run / ".",
        "dotdot": run / "capture" / "..",
        "symlink": tmp_path / "link",
        "relative": "two",
    }[spelling]
    if spelling == "symlink":
        out.symlink_to(run, target_is_directory=True)
    if spelling == "relative":
        monkeypatch.chdir(tmp_path)
    before = _sha256s(run)
    assert "manifest.json" in before and any(name.startswith("capture/") for name in before)
    err = _one_line_error(["what-if", str(run), "--out", str(out), "--eta", "0.5", "--overwrite", "-q"], capsys)
    assert _sha256s(run) == before, err
    assert "would write over the run" in err and f"--out {out}" in err, err
    # The Python API refuses it the same way.
    with pytest.raises(RunDirectoryError, match="would write over the run"):
        what_if_run(run, WhatIf(eta=0.5), out_dir=out, overwrite=True, progress=False)
    assert _sha256s(run) == before


def test_what_if_overwrite_replaces_only_a_what_if_output(runs, tmp_path, capsys):
    """--overwrite of what-if replaces the what-if output OUT holds, never a measured run (its capture
    could not be recovered): that is refused, with or without --overwrite, before anything is written."""
    measured = _copy(runs, "four", tmp_path)
    before = _sha256s(measured)
    for overwrite in ([], ["--overwrite"]):
        err = _one_line_error(["what-if", str(runs / "two"), "--out", str(measured), *overwrite, "-q"], capsys)
        assert f"{measured}: holds a run that is not a what-if output" in err and "choose another --out" in err, err
        assert _sha256s(measured) == before
    out = tmp_path / "wi"
    assert main(["what-if", str(runs / "two"), "--out", str(out), "-q"]) == 0
    first = _manifest(out)["run_id"]
    assert main(["what-if", str(runs / "two"), "--out", str(out), "--eta", "0.01", "--overwrite", "-q"]) == 0
    assert _manifest(out)["run_id"] != first and _manifest(out)["counterfactual"] is True


# 6. replay of a directory without capture/.

def test_replay_without_a_capture_says_why_and_leaves_the_tables(runs, tmp_path, capsys):
    from osdn_diag.pipeline import stream_run
    from osdn_diag.whatif import WhatIf, what_if_run

    stream = tmp_path / "stream"
    stream_run(MODEL, "random", stream, num_prompts=2, length=16, progress=False)
    what_if = what_if_run(runs / "two", WhatIf(eta=0.1), out_dir=tmp_path / "wi", progress=False)
    deleted = shutil.copytree(runs / "two", tmp_path / "deleted")
    shutil.rmtree(deleted / "capture")
    for directory, why in ((stream, "--stream"), (what_if, "what-if"), (deleted, "deleted")):
        before = _files(directory)
        err = _one_line_error(["replay", str(directory), "-q"], capsys)
        assert why in err and "untouched" in err, err
        assert _files(directory) == before
        load_run(directory)  # and the results are still the run's (what `report` checks)
    assert main(["report", str(deleted)]) == 0


# 7. A failed command leaves a finished run alone.

@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_a_failed_command_does_not_touch_a_finished_run(runs, tmp_path, capsys, overwrite):
    run = _copy(runs, "two", tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2, 3]}\nnot json\n')
    before = _files(run)
    err = _one_line_error(_args(run, 2, *overwrite, model="random:deltanet-tyni"), capsys)
    assert "deltanet-tyni" in err
    argv = ["run", MODEL, "--prompts", str(bad), "--out", str(run), "-q", *overwrite]
    err = _one_line_error(argv, capsys)
    # without --overwrite the run is refused from its files, before the prompts are read
    assert (f"{bad}:2" if overwrite else "already holds a run") in err
    assert _files(run) == before
    load_run(run)  # the results are still the run's: `report` takes them


# 10. No prompts.

def test_no_prompts_is_an_error_before_anything_is_written(tmp_path, capsys):
    err = _one_line_error(_args(tmp_path / "zero", 0), capsys)
    assert "--num-prompts" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    err = _one_line_error(["run", MODEL, "--prompts", str(empty), "--out", str(tmp_path / "e"), "-q"], capsys)
    assert str(empty) in err and "no prompts" in err
    assert not (tmp_path / "zero").exists() and not (tmp_path / "e").exists()


# 11. --overwrite removes only the run's own files; a directory that is not a run is refused.

def _user_files(root):
    files = {"plots/vacation.png": b"photo", "capture/experiment1.csv": b"data", "notes.txt": b"mine"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]], ids=["plain", "overwrite"])
def test_a_directory_that_is_not_a_run_is_refused_naming_what_collides(tmp_path, capsys, overwrite):
    home = tmp_path / "H"
    home.mkdir()
    _user_files(home)
    (home / "report.md").write_text("# my thesis")
    (home / "summary.json").write_text("{}")
    before = _files(home)
    err = _one_line_error(_args(home, 2, *overwrite, command="capture"), capsys)
    assert "not an osdn-diag run directory" in err and "choose another --out" in err
    assert "capture, summary.json, report.md, plots" in err
    assert _files(home) == before and sorted(p.name for p in home.iterdir()) == sorted(
        ["plots", "capture", "notes.txt", "report.md", "summary.json"])  # no lock file left either


def test_overwrite_removes_only_the_runs_own_files(runs, tmp_path, capsys):
    run = _copy(runs, "two", tmp_path)
    assert main(["report", str(run)]) == 0
    mine = _user_files(run)
    # A file of the user's in capture/, where a new capture would not replay beside it: refused before
    # anything is removed, naming it (issue 44).
    before = _files(run)
    err = _one_line_error(_args(run, 2, "--overwrite", command="capture"), capsys)
    assert str(run / "capture" / "experiment1.csv") in err and "move it out of" in err, err
    assert _files(run) == before
    (run / "experiment1.csv").write_bytes((run / "capture" / "experiment1.csv").read_bytes())
    (run / "capture" / "experiment1.csv").unlink()
    mine = {("experiment1.csv" if name == "capture/experiment1.csv" else name): data for name, data in mine.items()}
    (run / "what-if_mine").mkdir()
    (run / "what-if_mine" / "keep.txt").write_text("mine")
    old_id = _manifest(run)["run_id"]
    assert main(_args(run, 2, "--overwrite", command="capture")) == 0
    assert _manifest(run)["run_id"] != old_id
    for name, data in mine.items():
        assert (run / name).read_bytes() == data, name
    assert (run / "what-if_mine" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["vacation.png"]  # the report's plots went
    for name in ("report.md", "summary.json", "residuals.parquet", "comparator.parquet"):
        assert not (run / name).exists(), name
    assert {p for p in _shards(run) if p.endswith(".safetensors")} == set(_manifest(run)["shards"])
    # A directory holding only files a run never writes is fine.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(_args(other, 2, command="capture")) == 0 and (other / "notes.txt").read_text() == "mine"


def test_a_foreign_file_in_a_residuals_directory_is_refused_before_anything_changes(runs, tmp_path, capsys):
    """residuals.parquet/ (a table of parts, from a run under several processes) holding a file of the
    user's cannot be replaced by a new table: --overwrite and replay refuse it up front, naming it, and
    leave the run as it was (they removed the old run, captured or replayed again and then failed on
    a raw 'Directory not empty')."""
    run = _copy(runs, "two", tmp_path)
    (run / "residuals.parquet").unlink()
    (run / "residuals.parquet").mkdir()
    (run / "residuals.parquet" / "notes.txt").write_text("mine")
    before, manifest = _files(run), _manifest(run)
    for argv in (_args(run, 2, "--overwrite"), ["replay", str(run), "-q"]):
        err = _one_line_error(argv, capsys)
        assert f"{run / 'residuals.parquet' / 'notes.txt'}: not a file osdn-diag writes" in err, err
        assert "move it out of" in err
        assert _files(run) == before and _manifest(run) == manifest


def test_demo_refuses_an_existing_output_and_files_it_did_not_write(runs, tmp_path, capsys, monkeypatch):
    from osdn_diag import pipeline

    out = tmp_path / "Hd"
    (out / "mqar-deltanet" / "plots").mkdir(parents=True)
    (out / "mqar-deltanet" / "plots" / "figure1.png").write_text("precious")
    (out / "mqar-deltanet" / "report.md").write_text("notes")
    argv = ["demo", "--out", str(out), "--models", "mqar-deltanet", "--num-prompts", "1", "-q"]
    before = _files(out)
    for extra in ([], ["--overwrite"]):
        err = _one_line_error([*argv, *extra], capsys)
        assert "not an osdn-diag run directory" in err and "plots" in err
    shutil.rmtree(out / "mqar-deltanet")
    (out / "report").mkdir()
    (out / "report" / "report.md").write_text("# quarterly")
    before = _files(out)
    for extra in ([], ["--overwrite"]):
        err = _one_line_error([*argv, *extra], capsys)
        assert "not an osdn-diag report directory" in err and "report.md" in err
    assert _files(out) == before
    # An earlier demo's output (a run per model and a report of them) is replaced only with --overwrite.
    shutil.rmtree(out / "report")
    shutil.copytree(runs / "two", out / "mqar-deltanet")
    assert main(["report", str(out / "mqar-deltanet"), "--out", str(out / "report")]) == 0
    (out / "report" / "plots" / "mine.png").write_text("mine")
    before = _files(out)
    err = _one_line_error(argv, capsys)
    assert "--overwrite" in err and _files(out) == before
    calls = []  # the models' capture and replay stand in as the run already there (the report is real)
    monkeypatch.setattr(pipeline, "capture_run", lambda *a, **k: calls.append(k["overwrite"]))
    monkeypatch.setattr(pipeline, "replay_run", lambda *a, **k: None)
    assert entry([*argv, "--overwrite"]) == 0
    assert calls == [True] and (out / "report" / "plots" / "mine.png").read_text() == "mine"
    assert json.loads((out / "report" / "manifest.json").read_text())["kind"] == "report"


# 12. A what-if setting that cannot work is refused before the output is touched.

@pytest.mark.parametrize("bad", [["--eta", "-1"], ["--d-min", "3", "--d-max", "1"], ["--d-min", "-1"],
                                 ["--d-min", "3", "--d-max", "4"]])  # a box without d0 = 1
def test_a_bad_what_if_setting_leaves_the_output_alone(runs, tmp_path, capsys, bad):
    target = _copy(runs, "four", tmp_path)
    before = _files(target)
    _one_line_error(["what-if", str(runs / "two"), *bad, "--out", str(target), "--overwrite", "-q"], capsys)
    _one_line_error(["what-if", str(runs / "two"), *bad, "--out", str(tmp_path / "fresh"), "-q"], capsys)
    assert _files(target) == before and not (tmp_path / "fresh").exists()


# 13. One command at a time per directory.

def test_a_second_command_on_a_directory_in_use_is_refused(runs, tmp_path, capsys):
    import os
    import subprocess
    import sys

    from osdn_diag.rundir import LOCK_FILE, output_lock, prepare_output

    run = _copy(runs, "two", tmp_path)
    before = _files(run)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os, sys\nos.umask(0o077)\nfrom osdn_diag.rundir import output_lock\n"
         "with output_lock(sys.argv[1]):\n    print('held', flush=True)\n    sys.stdin.read()", str(run)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        lock = run / LOCK_FILE
        assert (lock.stat().st_mode & 0o777) == 0o644 and lock.read_text().strip() == str(holder.pid)
        for argv in (["replay", str(run), "-q"], _args(run, 2, "--overwrite"),
                     ["what-if", str(runs / "two"), "--out", str(run), "--overwrite", "-q"], ["report", str(run)]):
            err = _one_line_error(argv, capsys)
            assert f"{run} is in use by another osdn-diag command (pid {holder.pid}), which is writing into it; " \
                   "wait for it to finish" in err
        assert {k: v for k, v in _files(run).items() if k != LOCK_FILE} == before
    finally:
        holder.communicate("")
    assert not (run / LOCK_FILE).exists() and _files(run) == before
    # Within one process the lock is re-entrant, and --overwrite never removes it.
    with output_lock(run), output_lock(run):
        prepare_output(run, overwrite=True)
        assert (run / LOCK_FILE).is_file() and not (run / "manifest.json").exists()
    assert not (run / LOCK_FILE).exists()
    fresh = tmp_path / "new" / "dir"
    with output_lock(fresh):
        assert os.listdir(fresh) == [LOCK_FILE]
    assert not (tmp_path / "new").exists()  # nothing written: the directories it made are gone too


# 14. A what-if output can be moved with its source; a refused report changes nothing.

def test_a_what_if_output_moved_with_its_source_still_reports(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(runs / "two", "X")
    assert main(["what-if", "X", "--eta", "0.5", "-q"]) == 0
    name = "what-if_eta0.5_box0.5-2_r1_ba"
    assert _manifest(tmp_path / "X" / name)["source_run"] == str(tmp_path / "X")
    shutil.move("X", "Y")
    assert main(["report", f"Y/{name}"]) == 0
    # A what-if whose source is nowhere to be found: refused, naming both places, changing nothing.
    stale = tmp_path / "Y" / name
    manifest = _manifest(stale)
    manifest["source_run_id"] = "0" * 32
    (stale / "manifest.json").write_text(json.dumps(manifest))
    before = _files(stale)
    err = _one_line_error(["report", str(stale)], capsys)
    assert str(tmp_path / "X") in err and str(tmp_path / "Y") in err
    assert _files(stale) == before
    err = _one_line_error(["report", "Y", str(stale), "--out", "CMP"], capsys)
    assert not (tmp_path / "CMP").exists()


# 15. Reports and what-ifs do not write into another run.

def test_report_and_what_if_do_not_write_into_another_run(runs, tmp_path, capsys):
    a, b = _copy(runs, "two", tmp_path), _copy(runs, "four", tmp_path)
    before_a, before_b = _files(a), _files(b)
    err = _one_line_error(["report", str(a), "--out", str(b)], capsys)
    assert "a run directory" in err
    err = _one_line_error(["report", str(a), str(b), "--out", str(a)], capsys)
    assert "itself" in err
    _one_line_error(["report", str(a), "--out", str(b / "sub")], capsys)
    for out in (b / "capture", b / "sub"):
        err = _one_line_error(["what-if", str(a), "--out", str(out), "-q"], capsys)
        assert str(b) in err
    assert _files(a) == before_a and _files(b) == before_b and not (b / "sub").exists()


# 16. A changed shard: replay refuses it and leaves the run as it was.

def test_a_changed_shard_leaves_a_complete_run_complete(runs, tmp_path, capsys):
    run = _copy(runs, "two", tmp_path)
    shard = run / "capture" / "batch_00001" / "layer_001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    before = _files(run)
    stages = _manifest(run)["stages"]
    err = _one_line_error(["replay", str(run), "-q"], capsys)
    assert str(shard) in err and "sha256" in err
    assert _manifest(run)["stages"] == stages and _manifest(run)["complete"] is True
    assert {k: v for k, v in _files(run).items() if k != "manifest.json"} == \
        {k: v for k, v in before.items() if k != "manifest.json"}
    load_run(run)


# 17. A link is never written through (issue 44).

@pytest.mark.parametrize("where", ["lock", "dangling lock", "plots", "replay's summary", "what-if's own output"])
def test_a_command_never_writes_through_a_link(runs, tmp_path, capsys, where):
    import os
    import stat

    from osdn_diag.rundir import LOCK_FILE

    run = _copy(runs, "two", tmp_path)
    secret = tmp_path / "important.txt"
    secret.write_text("secret data")
    secret.chmod(0o600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "contraction.png").write_bytes(b"mine")
    argv = ["report", str(run)]
    if where == "lock":
        (run / LOCK_FILE).symlink_to(secret)
    elif where == "dangling lock":
        (run / LOCK_FILE).symlink_to(tmp_path / "created.txt")
    elif where == "plots":
        (run / "plots").symlink_to(elsewhere, target_is_directory=True)
    elif where == "what-if's own output":  # the directory what-if names below the run, planted as a link
        from osdn_diag.whatif import WhatIf

        (run / WhatIf(eta=0.003).name()).symlink_to(elsewhere, target_is_directory=True)
        argv = ["what-if", str(run), "-q"]
    else:
        (run / "summary.json").unlink()
        (run / "summary.json").symlink_to(secret)
        argv = ["replay", str(run), "-q"]
    before = {p.relative_to(run).as_posix(): os.readlink(p) if p.is_symlink() else p.read_bytes()
              for p in run.rglob("*") if p.is_symlink() or p.is_file()}
    err = _one_line_error(argv, capsys)
    assert ("not a lock file osdn-diag made" if "lock" in where else "a symbolic link, where osdn-diag writes") in err
    assert secret.read_text() == "secret data" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert not (tmp_path / "created.txt").exists()
    assert [p.name for p in elsewhere.iterdir()] == ["contraction.png"]
    assert (elsewhere / "contraction.png").read_bytes() == b"mine"
    assert before == {p.relative_to(run).as_posix(): os.readlink(p) if p.is_symlink() else p.read_bytes()
                      for p in run.rglob("*") if p.is_symlink() or p.is_file()}


# 18. --overwrite after an interrupted capture: its unlisted shards go, and the new run replays.

def test_overwrite_after_an_interrupted_capture_replays(runs, tmp_path):
    run = _copy(runs, "two", tmp_path)
    # What a capture killed mid-way leaves: shards on disk, a manifest that lists none of them yet.
    leftover = run / "capture" / "batch_00007" / "layer_000.safetensors"
    leftover.parent.mkdir()
    shutil.copyfile(run / "capture" / "batch_00000" / "layer_000.safetensors", leftover)
    manifest = _manifest(run)
    (run / "manifest.json").write_text(json.dumps({**manifest, "shards": {}, "complete": False,
                                                   "stages": {"capture": False}}))
    assert main(_args(run, 2, "--seed", "1", "--overwrite", command="capture")) == 0
    assert not leftover.parent.exists()
    assert main(["replay", str(run), "-q"]) == 0
    assert _summary(run)["q_geo"] == _summary(runs / "two")["q_geo"]


def test_table_cells_escape_pipes_and_line_breaks():
    from osdn_diag.report.markdown import _table

    lines = _table(["task"], [["a|b\nc"]]).splitlines()
    assert len(lines) == 3 and lines[2] == "| a\\|b c |"
