"""A full disk (ENOSPC; EDQUOT, EROFS likewise) is one line naming the file that could not be written
and what to do, exit status 2 — whatever the writer made of the error: pyarrow's OSError without a
file name inside the table writer's RuntimeError, matplotlib's AttributeError raised while handling
it, a bare ``os.write`` failure. Simulated by making the writers fail as they do on a full tmpfs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import pickle

import pytest

from osdn_diag.runtime.atomic import atomic_write_text
from osdn_diag.runtime.storage import StorageError
from osdn_diag.cli import entry

ARGS = ["random:deltanet-tiny", "--prompts", "random", "--num-prompts", "2", "--length", "8", "--device", "cpu", "-q"]


def _full(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "run"
    assert entry(["run", *ARGS, "--out", str(out)]) == 0
    return out


def _one_line(argv, capsys) -> str:
    capsys.readouterr()
    assert entry(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_replay_on_a_full_disk_names_the_table(run, monkeypatch, capsys):
    import pyarrow.parquet as pq

    before = json.loads((run / "manifest.json").read_text())
    monkeypatch.setattr(pq.ParquetWriter, "write_table", _full)
    err = _one_line(["replay", str(run), "--device", "cpu", "-q"], capsys)
    assert f"{run / 'residuals.parquet'}: writing failed (No space left on device); free space there or " \
           "choose another --out" in err, err
    # The run's state is still correct: its old tables, and its stages as they were.
    assert json.loads((run / "manifest.json").read_text())["stages"] == before["stages"]


def test_report_on_a_full_disk_names_the_figure(run, monkeypatch, capsys):
    from matplotlib.figure import Figure

    import osdn_diag.report.render as render

    def pdf_backend_on_a_full_disk(self, *args, **kwargs):
        try:
            _full()
        except OSError:  # matplotlib's PDF backend, cleaning up its stream
            raise AttributeError("'Stream' object has no attribute 'pos'")  # noqa: B904

    monkeypatch.setattr(Figure, "savefig", pdf_backend_on_a_full_disk)
    monkeypatch.setattr(render, "figure_workers", contextlib.nullcontext)  # drawn in this process
    err = _one_line(["report", str(run)], capsys)
    assert f"{run / 'plots'}/" in err and "writing failed (No space left on device); free space there" in err, err


def test_a_capture_shard_on_a_full_disk_names_the_shard(tmp_path, monkeypatch, capsys):
    # safetensors (Rust) raises a SafetensorError, no OSError, its errno only in the message
    from safetensors import SafetensorError

    import osdn_diag.capture.store as store

    def save_file_on_a_full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"\0" * 100)  # part of the shard was written
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(store, "save_file", save_file_on_a_full_disk)
    out = tmp_path / "run"
    err = _one_line(["run", *ARGS, "--out", str(out)], capsys)
    shard = out / "capture" / "batch_00000" / "layer_000.safetensors"
    assert f"{shard}: writing failed (No space left on device); free space there or choose another --out" in err, err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["stages"]["capture"] is False
    assert list(shard.parent.iterdir()) == []  # the partial shard's temporary is gone


def test_a_bare_write_error_names_the_file(tmp_path, monkeypatch):
    import builtins

    real_open = builtins.open

    class Full:
        def __init__(self, *a, **k):
            self.fh = real_open(*a, **k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, text):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setattr(builtins, "open", Full)
    with pytest.raises(StorageError, match=r"summary.json: writing failed \(Disk quota exceeded\); free space"):
        atomic_write_text(tmp_path / "summary.json", "{}")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []  # no temporary left behind


def test_the_error_crosses_processes():
    err = pickle.loads(pickle.dumps(StorageError(errno.ENOSPC, "No space left on device", "x/plots/a.pdf")))
    assert str(err) == "x/plots/a.pdf: writing failed (No space left on device); free space there or choose another --out"
