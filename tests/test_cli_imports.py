"""What `osdn-diag --help`, `prove` and `report` of an existing run import, each in a fresh interpreter:
none of torch, fla and transformers (seconds each on a cold start; issue 23: `--help` ≤ 0.5 s).

`report` of a run that stored its capture does import torch: the report checks that capture against
the manifest (``CaptureReader``, names and sizes) and reads its shards for the d plot, and
``osdn_diag.capture.store`` holds tensors. A `--stream` run has no capture: JSON and parquet only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from osdn_diag.cli import main

HEAVY = ("torch", "fla", "transformers")

# Runs ``entry(argv)`` in this fresh interpreter and prints which of HEAVY it imported. ``prove`` runs
# six of the ledger's quick claims (the whole ledger takes ~25 s here; none of its claims imports torch).
CODE = """
import contextlib, io, json, sys
argv = json.loads(sys.argv[1])
if argv[0] == "prove":
    from osdn_diag.proofs import ledger
    ledger.CLAIMS = ledger.CLAIMS[2:8]
from osdn_diag.cli import entry
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    rc = entry(argv)
assert rc == 0, (rc, out.getvalue())
print(json.dumps([m for m in %r if m in sys.modules]))
""" % (HEAVY,)


def _imported(argv: list[str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", CODE, json.dumps(argv)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stream_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("imports") / "run"
    assert main(["run", "random:deltanet-tiny", "--prompts", "random", "--num-prompts", "1", "--length", "16",
                 "--device", "cpu", "--stream", "--out", str(out), "-q"]) == 0
    (out / "report.md").unlink()  # written by run; report writes it again
    return out


@pytest.mark.parametrize("argv", [["--help"], ["report", "--help"], ["prove", "-q"]], ids=" ".join)
def test_help_and_prove_import_none_of_torch_fla_transformers(argv):
    assert _imported(argv) == []


def test_report_of_a_stream_run_imports_none_of_them(stream_run):
    assert _imported(["report", str(stream_run)]) == []
    assert (stream_run / "report.md").is_file()


# A failing command: prints which of HEAVY it imported, and its exit status and message.
FAILING = """
import contextlib, io, json, sys
from osdn_diag.cli import entry
err = io.StringIO()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
    rc = entry(json.loads(sys.argv[1]))
print(json.dumps([rc, err.getvalue(), [m for m in %r if m in sys.modules]]))
""" % (HEAVY,)


def _model_dir(tmp_path, name, files: dict[str, str]):
    d = tmp_path / name
    d.mkdir()
    for file, text in files.items():
        (d / file).write_text(text)
    return d


CONFIG = '{"model_type": "gated_deltanet", "num_heads": 2, "hidden_size": 64}'


@pytest.mark.parametrize("files,message", [
    ({"config.json": '{"model_type": "gated_deltanet", "num_heads": 0}', "model.safetensors": ""},
     "num_heads must be a positive integer"),
    ({"config.json": CONFIG}, "no *.safetensors weights in"),
    ({"config.json": CONFIG, "pytorch_model.bin": "x"}, "found pytorch_model.bin: pickled weights are not loaded"),
    ({"weights.safetensors": ""}, "expected a Hugging Face model directory with config.json"),
    ({"config.json": CONFIG.replace("}", ', "auto_map": {"AutoModel": "evil.Model"}}'), "model.safetensors": ""},
     "asks for custom code (auto_map: evil.Model)"),
    ({"config.json": CONFIG, "tokenizer_config.json": '{"auto_map": ["evil.Tok"]}', "model.safetensors": ""},
     "tokenizer_config.json asks for custom code"),
    ({"config.json": CONFIG, "model.safetensors": "garbage"}, "is not a readable safetensors file"),
], ids=["config-size", "no-weights", "pickles", "no-config", "auto-map", "tokenizer-auto-map", "bad-weights"])
def test_model_errors_found_from_files_import_none_of_them(tmp_path, files, message):
    """A model directory refused for what its files say fails before torch, fla or transformers is
    imported (seconds of a cold start): one line, exit 2, the loader's own message."""
    model = _model_dir(tmp_path, "model", files)
    argv = ["run", str(model), "--prompts", "mqar", "--num-prompts", "2", "--length", "64", "-q",
            "--out", str(tmp_path / "out")]
    done = subprocess.run([sys.executable, "-c", FAILING, json.dumps(argv)], capture_output=True, text=True,
                          timeout=120)
    rc, err, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert heavy == []
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overwrite", [False, True], ids=["run", "not-a-run"])
def test_an_out_the_run_would_refuse_is_refused_before_the_model_loads(stream_run, tmp_path, overwrite):
    """``run --out`` at a run without ``--overwrite``, or at a directory of a run's files without a
    manifest, is refused from the files alone: one line, exit 2, none of torch, fla and transformers
    imported (it came after the model had loaded: 5 to 20 s on this CPU)."""
    out = stream_run
    if overwrite:
        out = tmp_path / "not-a-run"
        out.mkdir()
        (out / "summary.json").write_text("{}")
    argv = ["run", "random:deltanet-tiny", "--prompts", "random", "--num-prompts", "1", "--length", "16",
            "--device", "cpu", "--stream", "--out", str(out), "-q", *(["--overwrite"] if overwrite else [])]
    done = subprocess.run([sys.executable, "-c", FAILING, json.dumps(argv)], capture_output=True, text=True,
                          timeout=120)
    rc, err, heavy = json.loads(done.stdout.strip().splitlines()[-1])
    message = "not an osdn-diag run directory" if overwrite else "already holds a run"
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert heavy == []
