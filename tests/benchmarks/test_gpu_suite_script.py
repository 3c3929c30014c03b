"""``benchmarks/gpu_suite.sh`` without a GPU: its steps run a stand-in Python that records what it was
asked to run, so what is tested is the script's own work — the per-step outputs and the archive a
machine that returns few files gets back."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The stand-in: a benchmark "runs" by printing its command line; targets.py, the suite's last step,
# prints the archive's members as they are when it starts.
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = benchmarks/targets.py ]; then tar tzf "$2/gpu_suite.tgz"; exit 0; fi
echo "ran $*"
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None,
                                reason="needs bash and tar")


def _suite_env(tmp_path: Path, **more: str) -> dict:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": str(fake), **more}


def _suite(tmp_path: Path, *steps: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), *steps], env=_suite_env(tmp_path),
                          capture_output=True, text=True, timeout=60)


def test_each_step_is_packed_as_soon_as_it_ends(tmp_path):
    done = _suite(tmp_path, "comparator", "phase1")
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    # Before the last step started, the archive already held both steps' outputs.
    listed = (out / "targets.txt").read_text().split()
    assert {"./comparator.txt", "./phase1.txt"} <= set(listed)
    with tarfile.open(out / "gpu_suite.tgz") as tar:
        members = {m.name for m in tar.getmembers()}
        text = tar.extractfile("./comparator.txt").read().decode()
    assert {"./comparator.txt", "./phase1.txt", "./targets.txt"} <= members
    assert "gpu_suite.tgz" not in " ".join(members)  # it never packs itself
    assert text.startswith("ran benchmarks/bench_comparator.py --json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "python"]  # no temporary left


def test_an_unknown_step_is_named(tmp_path):
    done = _suite(tmp_path, "comparatr")
    assert done.returncode == 2 and "unknown step comparatr" in done.stdout


def test_every_test_file_that_runs_on_a_gpu_is_in_a_step():
    """A test file that does something only where CUDA is available is run by one of the suite's
    test steps (named itself or by its folder), so that "every GPU test ran" means what it says."""
    import re

    script = (ROOT / "benchmarks" / "gpu_suite.sh").read_text()
    named = set(re.findall(r"\btests/[\w/.*]+", script))
    # conftest only sets the interpreter up without CUDA; test_examples passes it to the scripts it runs.
    not_gpu = {"tests/conftest.py", "tests/examples/test_examples.py"}
    # ``skipif(torch.cuda.is_available(), ...)`` marks a test of the machine without a GPU: not a GPU test.
    cpu_only = re.compile(r"skipif\(\s*torch\.cuda\.is_available\(\)")
    gpu_files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")
                 if re.search(r"cuda\.is_available\(\)", cpu_only.sub("", p.read_text()))
                 and not p.name.startswith("_")}

    def covered(path: str) -> bool:
        return any(path == n or path.startswith(n.rstrip("/") + "/")
                   or (("*" in n) and Path(path).match(n)) for n in named)

    missing = sorted(p for p in gpu_files - not_gpu if not covered(p))
    assert not missing, f"GPU test files no step of gpu_suite.sh runs: {missing}"


def test_lm_recipe_trains_the_recipe_the_built_in_models_record(tmp_path):
    """The lm_recipe step runs examples/train_lm.py with the arguments of the command that trained the
    shipped language models (lm_train_summary.json), the monitor on, from $LMDATA; without the corpus
    it says how to make it and runs nothing."""
    import json
    import shlex

    missing = tmp_path / "nodata"
    env_out = _suite_env(tmp_path, LMDATA=str(missing))
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "lm_recipe"], env=env_out,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"{missing}/train.bin is missing" in done.stdout
    assert "examples/train_lm.py prepare" in done.stdout and not (tmp_path / "out" / "lm_recipe.txt").exists()

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(b"\0\0")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "lm_recipe"],
                          env=_suite_env(tmp_path, LMDATA=str(data), LM_OUT=str(tmp_path / "lm")),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    ran = shlex.split((tmp_path / "out" / "lm_recipe.txt").read_text().removeprefix("ran "))
    summary = json.loads((ROOT / "osdn_diag" / "builtin" / "lm_train_summary.json").read_text())
    shipped = shlex.split(summary["command"])[2:]  # after "python examples/train_lm.py"

    def options(argv):  # {option: its values}, less where the data and output go and the time budget
        out, key = {}, None
        for word in argv:
            if word.startswith("--"):
                key = word
                out[key] = []
            elif key is not None:
                out[key].append(word)
        return {k: v for k, v in out.items() if k not in ("--data", "--out", "--time-budget")}

    assert ran[:2] == ["examples/train_lm.py", "train"] and shipped[0] == "train"
    assert ran[ran.index("--data") + 1] == str(data) and ran[ran.index("--out") + 1] == str(tmp_path / "lm")
    assert options(ran) == {**options(shipped), "--monitor-every": ["100"]}


def test_lm_recipe_never_empties_a_directory_it_did_not_make_and_returns_one_whole_archive(tmp_path):
    """LM_OUT naming a directory that holds something is refused and left as it was; unset, the step
    trains into a new directory of its own; the archive parts of an earlier run are removed before the
    new ones are written, so that joined they are one readable archive."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(b"\0\0")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("important")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "lm_recipe"],
                          env=_suite_env(tmp_path, LMDATA=str(data), LM_OUT=str(precious)),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"LM_OUT={precious} is not empty" in done.stdout
    assert (precious / "thesis.tex").read_text() == "important"
    assert not (tmp_path / "out" / "lm_recipe.txt").exists()

    out = tmp_path / "out"
    (out / "lm_recipe.tgz.part-zz").write_bytes(b"stale")  # an earlier run's last part
    env = _suite_env(tmp_path, LMDATA=str(data))
    env.pop("LM_OUT", None)
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "lm_recipe"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    ran = (out / "lm_recipe.txt").read_text().split()
    made = Path(ran[ran.index("--out") + 1])
    assert made.name.startswith("osdn_diag_lm_recipe.") and made.is_dir()
    assert ran[ran.index("--time-budget") + 1] == "450"
    parts = sorted(out.glob("lm_recipe.tgz.part-*"))
    assert [p.name for p in parts] == ["lm_recipe.tgz.part-aa"]
    joined = tmp_path / "joined.tgz"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as tar:
        tar.getmembers()
    made.rmdir()


def test_lm_recipe_resumes_a_run_it_stopped_and_returns_checkpoints_only_once_done(tmp_path):
    """LM_OUT holding a stopped run (train_lm.py's state.pt) is trained on, not refused; while the state is
    there nothing is archived and the step says how to go on; once training removed it, the checkpoints
    come back as one archive."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.bin").write_bytes(b"\0\0")
    lm = tmp_path / "lm"
    lm.mkdir()
    (lm / "state.pt").write_bytes(b"state")  # the stand-in Python leaves it: still stopped
    env = _suite_env(tmp_path, LMDATA=str(data), LM_OUT=str(lm))
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "lm_recipe"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    ran = (tmp_path / "out" / "lm_recipe.txt").read_text().split()
    assert ran[ran.index("--out") + 1] == str(lm)
    assert f"run this step again with LM_OUT={lm} on this machine to go on" in done.stdout
    assert not list((tmp_path / "out").glob("lm_recipe.tgz.part-*"))

    # This time the stand-in finishes the run as train_lm.py's last step does: state.pt removed.
    finish = tmp_path / "finishing-python"
    finish.write_text(FAKE_PYTHON.replace('echo "ran $*"', f'echo "ran $*"\nif [ "$1" = examples/train_lm.py ]; then '
                                          f'rm {lm}/state.pt; echo {{}} > {lm}/train_summary.json; fi'))
    finish.chmod(0o755)
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), "lm_recipe"],
                          env={**env, "PYTHON": str(finish)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    parts = sorted((tmp_path / "out").glob("lm_recipe.tgz.part-*"))
    joined = tmp_path / "joined.tgz"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as tar:
        assert "./train_summary.json" in tar.getnames()


def test_scale_steps_prepare_with_the_builtin_tokenizer_and_train_the_preset(tmp_path):
    """scale without a corpus says to prepare first; scale_prepare encodes with the built-in LMs'
    tokenizer; scale trains the preset into SCALE_OUT with its budget and returns its results."""
    env = _suite_env(tmp_path, SCALE_DATA=str(tmp_path / "sd"), SCALE_OUT=str(tmp_path / "so"), SCALE_PRESET="h768",
                     SCALE_ARGS="--steps 5")
    suite = ["bash", str(ROOT / "benchmarks" / "gpu_suite.sh")]
    done = subprocess.run([*suite, "scale"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "run the scale_prepare step first" in done.stdout
    done = subprocess.run([*suite, "scale_prepare"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    ran = (tmp_path / "out" / "scale_prepare.txt").read_text().split()
    assert ran[:3] == ["ran", "examples/scale_study.py", "prepare"]
    assert ran[ran.index("--tokenizer") + 1] == "osdn_diag/builtin/lm-corpus/"
    assert (ROOT / "osdn_diag" / "builtin" / "lm-corpus" / "tokenizer.json").is_file()
    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "train.bin").write_bytes(b"\0\0")
    (tmp_path / "so").mkdir()
    (tmp_path / "so" / "results.json").write_text('{"preset": "h768"}')
    done = subprocess.run([*suite, "scale"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    ran = (tmp_path / "out" / "scale_h768.txt").read_text().split()
    assert ran[ran.index("--out") + 1] == str(tmp_path / "so") and ran[ran.index("--preset") + 1] == "h768"
    assert ran[ran.index("--time-budget") + 1] == "480" and ran[-2:] == ["--steps", "5"]
    assert (tmp_path / "out" / "scale_h768_results.json").read_text() == '{"preset": "h768"}'
