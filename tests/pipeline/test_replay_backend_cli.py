"""``replay`` and ``what-if`` with a Triton replay (``--backend triton|fused``) on a machine without a
GPU: the interpreter is switched on before triton is imported, as ``run`` does, and the numbers are
the reference replay's. Fresh processes, without ``TRITON_INTERPRET`` in their environment: the
interpreter must be the command's own doing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: a machine without a GPU")


def _cli(*argv, cwd):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "osdn_diag", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_replay_and_what_if_take_a_triton_backend_on_the_cpu(tmp_path):
    done = _cli("run", "builtin:mqar-deltanet", "--prompts", "mqar", "--num-prompts", "2", "--length", "32",
                "--out", "r", "-q", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    reference = json.loads((tmp_path / "r" / "summary.json").read_text())
    for backend in ("fused", "triton"):
        done = _cli("replay", "r", "--backend", backend, "-q", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        summary = json.loads((tmp_path / "r" / "summary.json").read_text())
        assert summary["replay"]["backend"] == backend
        assert summary["q_geo"] == pytest.approx(reference["q_geo"], rel=1e-5)
    done = _cli("what-if", "r", "--backend", "triton", "--out", "w", "-q", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "w" / "summary.json").is_file()
