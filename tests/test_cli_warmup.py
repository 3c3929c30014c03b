"""``osdn-diag warmup MODEL``: one batch of the random suite at the runs' shape through the whole
diagnostic, into a temporary directory that is removed, leaving only Triton's cache behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "TMPDIR": str(tmp_path), **env}
    return subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_warmup_on_the_cpu_has_nothing_to_do(tmp_path):
    """Without a GPU: one line saying so, exit status 0, no model loaded and nothing written."""
    done = subprocess.run([sys.executable, "-m", "osdn_diag", "warmup", "random:deltanet-tiny", "--device", "cpu"],
                          env={**os.environ, "TMPDIR": str(tmp_path)}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "nothing to compile on the CPU" in done.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="pretends a GPU on a CPU-only machine; with a real "
                    "GPU the test below runs warmup itself")
def test_warmup_runs_one_batch_of_the_given_shape_and_keeps_nothing(tmp_path):
    """Where a GPU is seen (here pretended, the pipeline itself on the CPU): the whole diagnostic on
    one batch of ``--batch-size`` random prompts of ``--length`` tokens, in a scratch directory that is
    gone afterwards; the last line names the shape and Triton's cache."""
    cache = tmp_path / "triton"
    done = _python(f"""
import json, torch
torch.cuda.is_available = lambda: True          # the GPU branch, run on the CPU below
import osdn_diag.pipeline as pipeline
real, seen = pipeline.stream_run, {{}}
def stream_run(model, prompts, out, **kw):
    seen.update(model=model, prompts=prompts, out=str(out), **{{k: kw[k] for k in ("batch_size", "num_prompts", "length")}})
    kw["device"] = "cpu"
    summary = real(model, prompts, out, **kw)
    seen["n"] = summary["n"]
    return summary
pipeline.stream_run = stream_run
from osdn_diag.cli import main
rc = main(["warmup", "random:deltanet-tiny", "--length", "24", "--batch-size", "2", "-q"])
print(json.dumps(dict(rc=rc, **seen)))
""", tmp_path, TRITON_CACHE_DIR=str(cache), OSDN_DIAG_PARALLEL_COMPILE="0")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    seen = json.loads(lines[-1])
    assert seen["rc"] == 0 and seen["model"] == "random:deltanet-tiny" and seen["prompts"] == "random"
    assert (seen["batch_size"], seen["num_prompts"], seen["length"]) == (2, 2, 24)
    assert seen["n"] == 2 * 24 * 2 * 2  # prompts x tokens x layers x heads of deltanet-tiny
    assert not Path(seen["out"]).exists() and not Path(seen["out"]).parent.exists()
    message = lines[-2]
    assert "batches of 2 x 24 tokens compiled and autotuned" in message and str(cache) in message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles fla's kernels: needs a CUDA GPU")
def test_warmup_fills_the_triton_cache_on_a_gpu(tmp_path):
    """On a GPU with an empty Triton cache: after warmup the cache holds compiled kernels."""
    from osdn_diag.pipeline import has_compiled_kernels

    cache = tmp_path / "triton"
    done = subprocess.run([sys.executable, "-m", "osdn_diag", "warmup", "random:deltanet-tiny", "--length", "64",
                           "--batch-size", "2", "-q"], env={**os.environ, "TRITON_CACHE_DIR": str(cache)},
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert has_compiled_kernels(cache)


def test_warmup_checks_its_model_even_where_it_has_nothing_to_do(tmp_path):
    """An unknown preset or a missing directory is the usual one-line error (exit status 2), on the
    CPU too."""
    for spec in ("random:nope", str(tmp_path / "missing")):
        done = subprocess.run([sys.executable, "-m", "osdn_diag", "warmup", spec, "--device", "cpu"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (spec, done.stdout, done.stderr)
        assert done.stderr.startswith("osdn-diag: error: MODEL") and len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("where,message", [
    ("missing/t.json", "argument --save-tuning"),
    ("notes.json", "exists and is not a tuning table"),
    ("t.json", "nothing is autotuned on the CPU"),
])
def test_save_tuning_where_it_cannot_be_done_is_a_one_line_error(tmp_path, where, message):
    """--save-tuning into a folder that does not exist, over a file that is not a table, or on the
    CPU (where nothing is autotuned): exit status 2, one line, no file written."""
    if where == "notes.json":
        (tmp_path / where).write_text('{"a": 1}')
    done = subprocess.run([sys.executable, "-m", "osdn_diag", "warmup", "random:deltanet-tiny", "--device", "cpu",
                           "--save-tuning", str(tmp_path / where)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / where).exists() or (tmp_path / where).read_text() == '{"a": 1}'


@pytest.mark.parametrize("where,message", [
    ("link.json", "a symbolic link; osdn-diag never writes through a link nor replaces one"),
    ("run/summary.json", "one of the files of the run"),
    ("run/capture/tuning.json", "inside capture/ of the run"),
])
def test_save_tuning_is_checked_as_every_file_a_command_writes(tmp_path, capsys, where, message):
    """--save-tuning went through fewer checks than `view --out` or `prove --json`: a symbolic link
    (here dangling) was replaced by the table, and a path among a run's own files was written (a
    table in RUN/capture/, which every later replay of RUN then refused). Now it is refused as theirs
    are, before anything runs — on the CPU too, before the CPU's own refusal — and left as it was."""
    from osdn_diag.cli import entry

    (tmp_path / "link.json").symlink_to(tmp_path / "nowhere" / "table.json")
    (tmp_path / "run" / "capture").mkdir(parents=True)
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({"run_id": "a" * 32, "stages": {"capture": True}}))
    (tmp_path / "run" / "summary.json").write_text("{}")
    before = {p: (p.is_symlink(), p.read_text() if p.is_file() else None) for p in tmp_path.rglob("*")}
    capsys.readouterr()
    assert entry(["warmup", "random:deltanet-tiny", "--device", "cpu", "--save-tuning", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("osdn-diag: error: argument --save-tuning ") and str(tmp_path / where) in err
    assert message in err and err.count("\n") == 1, err
    assert {p: (p.is_symlink(), p.read_text() if p.is_file() else None) for p in tmp_path.rglob("*")} == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autotunes fla's kernels: needs a CUDA GPU")
def test_save_tuning_records_the_choices_a_gpu_run_made(tmp_path):
    """On a GPU: warmup --save-tuning writes a table of this GPU holding fla's autotuned kernels,
    which OSDN_DIAG_TUNING=FILE then accepts."""
    from osdn_diag.runtime.tuning import load_table

    table = tmp_path / "t.json"
    done = subprocess.run([sys.executable, "-m", "osdn_diag", "warmup", "random:deltanet-tiny", "--length", "64",
                           "--save-tuning", str(table), "-q"],
                          env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "OSDN_DIAG_TUNING": "off"},
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(table.read_text())
    assert data["device"] == torch.cuda.get_device_name() and data["choices"]
    os.environ["OSDN_DIAG_TUNING"] = str(table)
    try:
        assert len(load_table(torch.cuda.get_device_name())) == len(data["choices"])
    finally:
        del os.environ["OSDN_DIAG_TUNING"]
