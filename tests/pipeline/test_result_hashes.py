"""``summary.json`` and ``comparator.parquet`` are hashed into the manifest (``files``) when the replay
finishes, and checked when a run is read: an edited summary is refused, not reported. Also: a
``--d-head`` that names no captured d is refused instead of leaving the plot out silently.
"""

from __future__ import annotations

import json
import shutil

import pytest

from osdn_diag.cli import entry

ARGS = ["--prompts", "random", "--num-prompts", "2", "--length", "8", "--device", "cpu", "-q"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hashes") / "run"
    assert entry(["run", "random:deltanet-tiny", *ARGS, "--out", str(out)]) == 0
    return out


def _one_line(argv, capsys) -> str:
    capsys.readouterr()
    assert entry(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_the_manifest_records_the_results(run):
    files = json.loads((run / "manifest.json").read_text())["files"]
    assert sorted(files) == ["comparator.parquet", "residuals.parquet", "summary.json"]
    assert files["summary.json"]["size"] == (run / "summary.json").stat().st_size
    import pyarrow.parquet as pq

    assert files["residuals.parquet"] == {"size": (run / "residuals.parquet").stat().st_size,
                                          "rows": pq.read_table(run / "residuals.parquet").num_rows}


@pytest.mark.parametrize("edit", ["filtered", "same size, fewer rows"])
def test_an_edited_per_token_table_is_refused_by_report_and_view(run, tmp_path, capsys, edit):
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / "residuals.parquet"
    table = pq.read_table(path)
    pq.write_table(table.filter(pc.equal(table["layer"], 0)), path)  # its run id (schema metadata) kept
    if edit == "same size, fewer rows":  # the manifest's size made to match: the row count still tells
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest["files"]["residuals.parquet"]["size"] = path.stat().st_size
        (copy / "manifest.json").write_text(json.dumps(manifest))
    for argv in (["report", str(copy)], ["view", str(copy)]):
        err = _one_line(argv, capsys)
        assert str(path) in err and "was changed after the run wrote it" in err, err
        assert ("bytes, manifest.json records" if edit == "filtered" else "rows, manifest.json records") in err


def test_a_result_listed_without_its_sha256_is_refused(run, tmp_path, capsys):
    """Only the per-token table is recorded by size and rows: a summary so listed is not trusted."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["summary.json"] = {"size": (copy / "summary.json").stat().st_size, "rows": 1}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    err = _one_line(["report", str(copy)], capsys)
    assert str(copy / "summary.json") in err and "sha256 differs" in err, err


@pytest.mark.parametrize("name", ["summary.json", "comparator.parquet"])
def test_an_edited_result_is_refused(run, tmp_path, capsys, name):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    if name == "summary.json":  # still valid, still this run's: only its numbers changed
        summary = json.loads((copy / name).read_text())
        summary["q_geo"] = 0.1
        (copy / name).write_text(json.dumps(summary, indent=2))
    else:
        data = bytearray((copy / name).read_bytes())
        data[len(data) // 2] ^= 1
        (copy / name).write_bytes(bytes(data))
    err = _one_line(["report", str(copy)], capsys)
    assert str(copy / name) in err and "was changed after the run wrote it" in err, err
    assert f"osdn-diag replay {copy}" in err, err


def test_what_if_records_its_own_results(run, tmp_path):
    out = tmp_path / "wi"
    assert entry(["what-if", str(run), "--out", str(out), "--device", "cpu", "-q"]) == 0
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert files != json.loads((run / "manifest.json").read_text())["files"]


@pytest.mark.parametrize("d_head, message", [
    ("9.9", "no run has a write-key preconditioner d in layer 9"),
    ("0.0", "no run has a write-key preconditioner d in layer 0"),  # a run without d at all
    ("+1.0", "expected LAYER.HEAD"),
    (" 1.0", "expected LAYER.HEAD"),
])
def test_a_d_head_that_names_nothing_is_refused(run, capsys, d_head, message):
    err = _one_line(["report", str(run), f"--d-head={d_head}"], capsys)
    assert message in err, err
