"""A run directory is a unit: one run id in the manifest, every shard and every table; the capture
is exactly the shards the manifest lists (by name, size and sha256); ``"complete": true`` only once
every stage a command set out to do has finished; an existing run is replaced only with
``--overwrite``, and only once the new command's inputs have loaded.

Each test is one scenario of the reported failures (issue 18), on a tiny random model.
"""

from __future__ import annotations

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
    from osdn_diag.replayer import Replayer

    def crash(self, stored):
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
    assert f"{bad}:2" in err
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
