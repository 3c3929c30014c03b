"""The line a run prints before its first batch on a GPU whose Triton cache holds no compiled kernel
yet (fla's kernels compile and autotune on their first call: minutes of silence otherwise).

On a CPU nothing compiles; the tests say the device is one that does (``_compiles_kernels``) and point
``TRITON_CACHE_DIR`` at a directory of their own."""

from __future__ import annotations

import pytest

from osdn_diag import pipeline
from osdn_diag.cli import main

NOTICE = "fla compiles and autotunes its Triton kernels on their first call on this machine"


def _capture(tmp_path, capsys, *extra: str) -> str:
    """stderr of a two-batch capture, notices counted by the caller."""
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    assert main(["capture", "random:deltanet-tiny", "--prompts", "random", "--num-prompts", "2", "--length", "8",
                 "--device", "cpu", "--out", str(out), *extra]) == 0
    return capsys.readouterr().err


@pytest.fixture
def compiling(monkeypatch, tmp_path):
    monkeypatch.setattr(pipeline.session, "_compiles_kernels", lambda device: True)  # where the session looks it up
    cache = tmp_path / "triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    runs = tmp_path / "runs"
    runs.mkdir()
    return cache, runs


def test_an_empty_cache_gets_one_line_before_the_first_batch(compiling, capsys):
    cache, runs = compiling
    err = _capture(runs, capsys)
    assert err.count(NOTICE) == 1, err
    assert str(cache) in err
    assert err.index(NOTICE) < err.index("capture")  # before the batches' progress bar
    # A cache folder that holds only Triton's launcher stubs has no kernels yet.
    (cache / "a1b2").mkdir(parents=True)
    (cache / "a1b2" / "cuda_utils.so").write_bytes(b"")
    assert _capture(runs, capsys).count(NOTICE) == 1


def test_no_line_with_quiet_or_a_populated_cache(compiling, capsys):
    cache, runs = compiling
    assert NOTICE not in _capture(runs, capsys, "--quiet")
    (cache / "c3d4").mkdir(parents=True)
    (cache / "c3d4" / "chunk_fwd_kernel_o.cubin").write_bytes(b"\0")
    assert NOTICE not in _capture(runs, capsys)


def test_no_line_where_nothing_compiles(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "empty"))
    assert NOTICE not in _capture(tmp_path, capsys)  # the CPU: fla's kernels run interpreted


def test_the_cache_is_where_triton_looks(monkeypatch, tmp_path):
    knobs = pytest.importorskip("triton.knobs")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    assert str(pipeline.triton_cache_dir()) == knobs.cache.dir == str(tmp_path / ".triton" / "cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert str(pipeline.triton_cache_dir()) == knobs.cache.dir
