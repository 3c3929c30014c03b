"""On a GPU: ``examples/train_lm.py train`` stopped and resumed ends where one command ends.

The CPU test (tests/examples/test_train_lm.py) checks the resumed run bit for bit; here what only a GPU
run exercises: the state saved from CUDA tensors is read back (the batch generator's state onto the
CPU, the models' and optimisers' onto the GPU) and training goes on under bf16 autocast with fla's
compiled kernels and the monitor, to the same losses and probes as an uninterrupted run: as close as two
uninterrupted runs are to each other (two identical training runs on a GPU need not end bit for bit
equal), and equal where those two are.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fla's compiled kernels)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1: fla's kernels would be interpreted, not compiled"),
    pytest.mark.usefixtures("fla_kernels"),
]

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("train_lm_gpu_under_test", ROOT / "examples" / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_resumed_gpu_run_ends_as_one_command(tmp_path):
    from osdn_diag.prompts import corpus

    script = _script()
    lib = tmp_path / "lib"
    for i, rel in enumerate(["mod1.py", "mod2.py", "mod3.py", "pkg/sub1.py", "mod28.py", "pkg/sub6.py"]):
        (lib / rel).parent.mkdir(parents=True, exist_ok=True)
        (lib / rel).write_text("\n".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(200)))
    data = tmp_path / "data"
    script.main(["prepare", "--data", str(data), "--stdlib", str(lib), "--vocab", "300"])
    assert corpus.corpus_info(data)["train_tokens"] > 0
    argv = ["train", "--device", "cuda", "--arch", "deltanet", "osdn:0.03", "--hidden", "64", "--layers", "1",
            "--heads", "2", "--intermediate", "128", "--seq", "64", "--batch", "4", "--steps", "3",
            "--eval-windows", "2", "--warmup", "1", "--monitor-every", "1", "--monitor-windows", "1",
            "--data", str(data)]
    # Two uninterrupted runs: how far apart two identical GPU runs end is the yardstick the resumed run is
    # held to (a first version of this test, held to 1e-3, saw the resumed run's held-out NLL 1.7e-3 from
    # the whole run's on an H100). On an H100 (benchmarks/CHANGELOG.md, series 30) the resumed run equalled
    # the second uninterrupted run bit for bit, and DeltaNet's three runs were equal; OSDN's first run in
    # the process, the one during which fla's kernels autotune, ended 9e-3 apart from the other two.
    wholes = []
    for i in range(2):
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]), contextlib.redirect_stderr(io.StringIO()):
            wholes.append(script.main([*argv, "--out", str(tmp_path / f"whole{i}")]))
    whole, again = wholes
    out = tmp_path / "parts"
    for _ in range(2):
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]), contextlib.redirect_stderr(io.StringIO()):
            script.main([*argv, "--out", str(out), "--stop-after", "1"])
        assert (out / "state.pt").is_file()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]), contextlib.redirect_stderr(io.StringIO()) as err:
        resumed = script.main([*argv, "--out", str(out)])
    assert "resumed" in err.getvalue() and not (out / "state.pt").exists()
    for name in whole:
        a, b, c = whole[name], resumed[name], again[name]
        assert b["steps"] == a["steps"] == 3 and b["monitor"]["probes"] == a["monitor"]["probes"] == 3

        def near(x, y, z, what):
            # The resumed run is as close to the first as the second uninterrupted run is (four times that
            # distance, for the spread of a three-run sample), or equal to 1e-6 where those two agree.
            bound = max(4 * abs(z - x), 1e-6 * abs(x))
            print(f"{name} {what}: the resumed run {abs(y - x):.3g} from the whole run, the whole run again "
                  f"{abs(z - x):.3g}")  # seen with pytest -s or -rP: how reproducible GPU training is
            assert abs(y - x) <= bound, (f"{name} {what}: whole {x!r}, resumed {y!r}, whole again {z!r}: "
                                         f"the resumed run is {abs(y - x):.3g} away, two whole runs {abs(z - x):.3g}")

        near(a["loss"], b["loss"], c["loss"], "loss")
        near(a["heldout_nll"], b["heldout_nll"], c["heldout_nll"], "heldout_nll")
        for x, y, z in zip(a["monitor"]["q_by_step"], b["monitor"]["q_by_step"], c["monitor"]["q_by_step"]):
            assert x["step"] == y["step"] == z["step"]
            near(x["q_geo"], y["q_geo"], z["q_geo"], f"q_geo at step {x['step']}")
