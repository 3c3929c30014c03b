"""Damaged run files (wrong types, missing keys) are refused on read in one line naming the file and
the key, with exit status 2 — not an AttributeError, TypeError or KeyError deep in report or replay.
"""

from __future__ import annotations

import json
import shutil

import pytest

from osdn_diag.runtime.schema import SchemaError, check_manifest, check_summary
from osdn_diag.cli import entry
from osdn_diag.demo import view_available

DAMAGES = [
    ("stages-list", "manifest.json", lambda m: m.update(stages=[]), "key 'stages' should be an object"),
    ("stage-not-bool", "manifest.json", lambda m: m["stages"].update(replay="yes"), "key 'stages.replay' should be true or false"),
    ("shards-null", "manifest.json", lambda m: m.update(shards=None), "key 'shards' should be an object"),
    ("shard-size-str", "manifest.json",
     lambda m: next(iter(m["shards"].values())).update(size="1"), "{sha256: string, size: integer}"),
    ("prompts-str", "manifest.json", lambda m: m.update(prompts="x"), "key 'prompts' should be a list"),
    ("prompt-id-str", "manifest.json", lambda m: m["prompts"][0].update(id="0"), "key 'prompts[0].id'"),
    ("layers-int", "manifest.json", lambda m: m.update(layers=3), "key 'layers' should be a list"),
    ("tokens-int", "manifest.json", lambda m: m.update(tokens=7), "key 'tokens' should be an object"),
    ("tokens-no-sha256", "manifest.json", lambda m: m["tokens"].pop("sha256"), "key 'tokens' should be an object"),
    ("skipped-str", "manifest.json", lambda m: m.update(layers_skipped="x"), "key 'layers_skipped' should be a list"),
    ("kernels-null", "manifest.json", lambda m: m.update(kernels=None), "key 'kernels' should be a list"),
    ("model-spec-int", "manifest.json", lambda m: m["model"].update(spec=7), "key 'model.spec' should be a string"),
    ("summary-no-fidelity", "summary.json", lambda s: s.pop("fidelity"), "key 'fidelity' is missing"),
    ("summary-q-geo-str", "summary.json", lambda s: s.update(q_geo="x"), "key 'q_geo' should be a number"),
    ("summary-by-layer-list", "summary.json", lambda s: s.update(by_layer=[1]), "key 'by_layer' should be an object"),
    ("summary-by-layer-cell", "summary.json", lambda s: s["by_layer"].update({"000": {"q_geo": 1}}),
     "key 'by_layer.000' should be {q_geo: number"),
    # Every key the report and the view read, not only the headline ones.
    ("summary-bins-null", "summary.json", lambda s: s.update(position_bins=None), "key 'position_bins' should be an object"),
    ("summary-bins-short", "summary.json", lambda s: s["position_bins"].update(q_geo=[1]),
     "key 'position_bins' should be {q_geo, q_arith: 10 numbers"),
    ("summary-bins-task-null", "summary.json", lambda s: s["position_bins"].update(by_task=None),
     "key 'position_bins.by_task' should be an object"),
    ("summary-assumptions-null", "summary.json", lambda s: s.update(assumptions=None),
     "key 'assumptions' should be an object"),
    ("summary-box-null", "summary.json", lambda s: s["assumptions"].update(box=None), "key 'assumptions.box' should be"),
    ("summary-failed-null", "summary.json", lambda s: s["assumptions"].update(hypotheses_failed=None),
     "key 'assumptions.hypotheses_failed' should be"),
    ("summary-family-null", "summary.json", lambda s: s.update(by_family=None), "key 'by_family' should be an object"),
    ("summary-replay-null", "summary.json", lambda s: s.update(replay=None), "key 'replay' should be an object"),
    ("summary-head-name", "summary.json", lambda s: s.update(by_head={"x": {"q_geo": 1, "q_arith": 1, "n": 1}}),
     "key 'by_head' holds an entry named 'x'"),
    ("summary-comparator-str", "summary.json", lambda s: s["comparator"].update(eps_diag_mean="x"),
     "key 'comparator.eps_diag_mean' should be a number"),
    ("summary-recall-str", "summary.json", lambda s: s.update(recall={"mqar": {"accuracy": "x", "queries": 1}}),
     "key 'recall.mqar.accuracy' should be a number"),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("damaged") / "run"
    assert entry(["run", "random:deltanet-tiny", "--prompts", "random", "--num-prompts", "2", "--length", "8",
                  "--device", "cpu", "-q", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("name, file, damage, message", DAMAGES, ids=[d[0] for d in DAMAGES])
def test_a_damaged_file_is_one_line(run, tmp_path, capsys, name, file, damage, message):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    data = json.loads((copy / file).read_text())
    damage(data)
    (copy / file).write_text(json.dumps(data))
    if file == "summary.json":  # its sha256 would be refused first: the schema, as a run without hashes
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest.pop("files", None)
        (copy / "manifest.json").write_text(json.dumps(manifest))
    commands = [["report", str(copy)]]
    if file == "summary.json" and view_available():  # the view reads the same keys
        commands.append(["view", str(copy), "--out", str(tmp_path / "view.html")])
    if file == "manifest.json":
        commands.append(["replay", str(copy), "--device", "cpu", "-q"])
    capsys.readouterr()
    for argv in commands:
        assert entry(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert f"{copy / file}: " in err and message in err, err
        assert "re-run the command that wrote it" in err or "osdn-diag replay" in err, err


def test_what_osdn_diag_writes_passes(run):
    check_manifest(json.loads((run / "manifest.json").read_text()), "m")
    check_summary(json.loads((run / "summary.json").read_text()), "s")
    with pytest.raises(SchemaError, match="not a JSON object"):
        check_summary([], "s")


def test_a_check_the_report_does_not_know_is_named_as_it_is(run, tmp_path, capsys):
    """``assumptions.hypotheses_failed`` counts per check: a check named otherwise than the report's
    words for them (a summary of a later version) is shown under its own name, not a KeyError."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    summary = json.loads((copy / "summary.json").read_text())
    summary["assumptions"]["hypotheses_failed"] = {"keys_bounded": 1}
    (copy / "summary.json").write_text(json.dumps(summary))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.pop("files", None)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert entry(["report", str(copy)]) == 0, capsys.readouterr().err
    assert "keys_bounded: 1" in (copy / "report.md").read_text()


def _within(seconds, argv):
    """``entry(argv)``'s status, or ``None`` if it has not finished after ``seconds`` (a reader waiting
    on a FIFO: pyarrow retries the interrupted open, so the test cannot signal it out of the wait)."""
    import threading

    done = []
    worker = threading.Thread(target=lambda: done.append(entry(argv)), daemon=True)
    worker.start()
    worker.join(seconds)
    return done[0] if done else None


@pytest.mark.parametrize("name", ["comparator.parquet", "residuals.parquet", "tokens.parquet"])
def test_a_fifo_in_place_of_a_run_file_is_refused_not_waited_on(run, tmp_path, capsys, name):
    import os

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    (copy / name).unlink()
    os.mkfifo(copy / name)
    capsys.readouterr()
    assert _within(60, ["report", str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{copy / name}: not a regular file" in err, err
    assert (copy / name).exists() and not (copy / name).is_file()  # left alone


def _damage_a_page(path) -> None:
    """Flip the bytes of ``path``'s first data page (its footer intact: the schema still reads)."""
    import pyarrow.parquet as pq

    data = bytearray(path.read_bytes())
    data[8:200] = bytes(b ^ 0xFF for b in data[8:200])
    path.write_bytes(bytes(data))
    pq.read_schema(path)
    with pytest.raises(Exception):  # noqa: B017 - pyarrow's own error, which names no file
        pq.read_table(path)


@pytest.mark.parametrize("name", ["residuals.parquet", "comparator.parquet"])
def test_a_table_that_cannot_be_read_is_named(run, tmp_path, capsys, name):
    """A damaged page of a run's table: every reader (view, report, Results.load) refuses it in one
    line naming the file and saying to replay, not pyarrow's 'Corrupt snappy compressed data.'."""
    import hashlib

    from osdn_diag.replay import Results
    from osdn_diag.rundir import RunDirectoryError

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    _damage_a_page(copy / name)
    manifest = json.loads((copy / "manifest.json").read_text())
    if name in manifest.get("files", {}):  # as if written so: the reader, not the hash, meets the damage
        data = (copy / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        (copy / "manifest.json").write_text(json.dumps(manifest))
    want = f"{copy / name}: damaged, cannot be read ("
    commands = [["view", str(copy), "--out", str(tmp_path / "v.html")]] if view_available() else []
    if name == "comparator.parquet":
        commands.append(["report", str(copy)])
    capsys.readouterr()
    for argv in commands:
        assert entry(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and want in err and f"run `osdn-diag replay {copy}` again" in err, err
    if name == "residuals.parquet":
        with pytest.raises(RunDirectoryError, match="residuals.parquet: damaged, cannot be read"):
            Results.load(copy)


def test_a_device_in_place_of_a_hashed_file_is_refused():
    from osdn_diag.rundir import RunDirectoryError, sha256_file

    with pytest.raises(RunDirectoryError, match="/dev/zero: not a regular file"):
        sha256_file("/dev/zero")


def test_an_edited_tokens_table_is_refused(run, tmp_path, capsys):
    import pyarrow.parquet as pq

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    table = pq.read_table(copy / "tokens.parquet")  # the run's id kept, two rows fewer
    pq.write_table(table.slice(2).replace_schema_metadata(table.schema.metadata), copy / "tokens.parquet")
    capsys.readouterr()
    assert entry(["report", str(copy)]) == 2
    err = capsys.readouterr().err
    assert f"{copy / 'tokens.parquet'}: " in err and "manifest.json records" in err, err
    (copy / "tokens.parquet").unlink()  # a listed file that is gone is refused too
    assert entry(["report", str(copy)]) == 2
    assert f"{copy / 'tokens.parquet'}: missing" in capsys.readouterr().err
